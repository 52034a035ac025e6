"""Which path multiplies a matmul: fixed per kernel variant when the model is loaded
(backend.py's table), and the same logits whichever path a shape takes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import TinyModels
from test_native_kernel import ISAS, require_native_kernels

from radixlm.cache.kv_pool import KVPool
from radixlm.model import native, packed_linear
from radixlm.model.backend import ALL_ROWS, Route, matmul_route
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import load_causal_lm
from radixlm.model.transformer import CausalLM, Linear

TINY = "llama-gqa-llama3rope"


def linears(model: CausalLM) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("isa", ISAS)
def test_each_matmul_goes_to_the_faster_path(
    tiny_hf_model: TinyModels, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode batches go native on every variant (on generic, those skinny_linear streams);
    prefill chunks through the tiles where the kernels prefer them to oneDNN (avx512), else
    oneDNN-packed weights, and on generic dense weights (F.linear), which the PyTorch path
    then multiplies too."""
    kernels = require_native_kernels(isa)
    monkeypatch.setenv("RADIXLM_ISA", isa)
    path = str(tiny_hf_model(TINY).path)
    model = load_causal_lm(path)
    onednn = isa != "generic" and packed_linear.packs(torch.float32)
    assert all(m.weight.is_mkldnn == onednn for m in linears(model))
    rows = model.backend.native_linear_rows
    assert rows >= (native.NATIVE_LINEAR_ROWS if onednn else native.SKINNY_MAX_ROWS)
    tiles = onednn and kernels.runs_linear(ALL_ROWS, onednn_packed=True)  # avx512's
    assert (rows == ALL_ROWS) == tiles
    for m in linears(model):  # the one route rule (matmul_route) reads the backend's row limit
        packed = Route.SKINNY if m.skinny is not None else Route.PYTORCH
        assert matmul_route(m, rows, rows) is packed
        if rows < ALL_ROWS:
            assert matmul_route(m, rows + 1, rows) is Route.PYTORCH
    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    reference_path = load_causal_lm(path)
    assert reference_path.backend.native_linear_rows == 0
    assert all(m.weight.is_mkldnn == onednn for m in linears(reference_path))


def test_past_the_native_rows_a_decode_takes_the_layer_loop(
    tiny_hf_model: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pure decode batch larger than the kernels' matmul rows leaves the fused decode step
    (which has only skinny_linear) for the layer loop, with the same logits."""
    require_native_kernels("generic")
    monkeypatch.setenv("RADIXLM_ISA", "generic")
    model = load_causal_lm(str(tiny_hf_model(TINY).path))
    c = model.config
    assert model.backend.fused is not None
    batch_size, context = 6, 5  # fewer rows than native.SKINNY_MAX_ROWS: fused on generic
    pool = KVPool(batch_size * (context + 1), c.num_layers, c.num_kv_heads, c.head_dim)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, c.vocab_size, context).tolist() for _ in range(batch_size)]
    seqs = [pool.alloc(context) for _ in prompts]
    empty = [np.zeros(0, dtype=np.int64)] * batch_size
    model(ForwardBatch.build(prompts, empty, seqs), pool)
    new = [pool.alloc(1) for _ in prompts]
    step = ForwardBatch.build([[p[-1]] for p in prompts], seqs, new)
    fused = model(step, pool)
    calls: list[int] = []
    assert model.backend.fused is not None
    real = model.backend.fused.run

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(model.backend.fused, "run", counted)
    for rows in (batch_size, batch_size - 1):  # fused, then the layer loop
        model.backend = type(model.backend)(model.backend.kernels, model.backend.fused, rows)
        assert torch.allclose(model(step, pool), fused, atol=1e-4)
    assert calls == [1]
