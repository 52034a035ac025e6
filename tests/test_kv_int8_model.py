"""A model over an int8 KV pool: its logits stay within a stated bound of the same model over a
float32 pool, on every attention path, and the int8 paths are exact where they must be.

Bound (tiny random models, a prefill then decode steps, each step's logits against the float32
pool's): mean KL(float || int8) <= 1e-4 and max |logit difference| <= 0.1 x the float logits'
standard deviation; measured at most 1.1e-5 and 0.034 x on every flag combination and path
(top-1 agreement is no bound for random models, whose near-ties flip: 96-100 %). The default
model's bound on a fixed text is in test_model_default.py. Greedy identity with the cache on
and off over an int8 pool: test_engine.py and test_model_numerics.py (native kernels), the
PyTorch path's here, with the sharper rule under it: cached-prefix logits equal uncached ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import new_engine, outputs, run
from helpers import TinyModel, TinyModels
from test_model_numerics import EMPTY, Session, random_ids
from test_native_kernel import ISAS, require_native_kernels

from radixlm.model.loader import load_causal_lm
from radixlm.model.transformer import CausalLM

MAX_MEAN_KL = 1e-4
MAX_LOGIT_DIFF = 0.1  # times the float logits' standard deviation


def prefill_and_decode(model: CausalLM, kv_dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits (24 + 8 steps, vocab): a 24-token prefill whose every row is kept, then 8 decode
    steps of three requests, two on the first one's prefix (a shared run) and one alone."""
    session = Session(model, seed=seed, kv_dtype=kv_dtype)
    ids = random_ids(48, seed=seed)
    logits, (shared,) = session.forward([ids[:24]], [EMPTY], all_logits=True)
    _, tails = session.forward([ids[24:30], ids[30:33]], [shared, shared], all_logits=False)
    slots = [*tails, session.prefill(ids[33:45])]
    rows = [logits]
    for step in range(8):
        step_logits, slots = session.forward([[ids[step + i]] for i in range(3)], slots, False)
        rows.append(step_logits)
    return torch.cat(rows)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.fixture(params=[*ISAS, "torch"], ids=[*(f"native-{i}" for i in ISAS), "torch-attention"])
def path(request, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    if request.param != "torch":
        monkeypatch.setenv("RADIXLM_ISA", request.param)
        require_native_kernels(request.param)
    return str(request.param)


def load(tiny: Path, path: str, dtype: str = "float32") -> CausalLM:
    model = load_causal_lm(str(tiny), dtype=dtype)
    if path == "torch":
        model.use_kernels(None)
    assert model.native_kernels == (path != "torch")
    return model


def test_int8_kv_logits_stay_within_the_bound_of_the_float_pool(
    each_tiny_hf_model: TinyModel, path: str
) -> None:
    """Every flag combination and attention path: the int8 pool's logits stay within the bound
    of the float32 pool's (prefill rows, decodes on a shared run and alone)."""
    model = load(each_tiny_hf_model.path, path)
    floats = prefill_and_decode(model, torch.float32, seed=1)
    int8 = prefill_and_decode(model, torch.int8, seed=1)
    assert not torch.equal(floats, int8)  # the int8 pool really ran
    assert mean_kl(floats, int8) <= MAX_MEAN_KL
    assert (floats - int8).abs().max() <= MAX_LOGIT_DIFF * floats.std()


@pytest.mark.parametrize("prefix_len", [1, 12, 23])
def test_cached_prefix_logits_equal_uncached_over_int8(
    each_tiny_hf_model: TinyModel, path: str, prefix_len: int
) -> None:
    """Over an int8 pool as over a float one (fp32: max abs difference <= 1e-4), the logits of
    a prompt extending its cached prefix equal those of the prompt prefilled whole: every path
    attends the new tokens' K/V as the pool holds them, never the values before quantization."""
    model = load(each_tiny_hf_model.path, path)
    ids = random_ids(24, seed=prefix_len)
    whole, _ = Session(model, seed=4, kv_dtype=torch.int8).forward([ids], [EMPTY], True)
    session = Session(model, seed=4, kv_dtype=torch.int8)
    prefix = session.prefill(ids[:prefix_len])
    extended, _ = session.forward([ids[prefix_len:]], [prefix], all_logits=True)
    assert (extended - whole[prefix_len:]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_and_pytorch_int8_paths_store_the_same_codes(
    tiny_hf_model: TinyModels, dtype: str
) -> None:
    """The native rope_store and the PyTorch write quantize alike (csrc/rope_store.c mirrors
    cache/kv_quant.py): after the same prefill both pools hold the same scales and codes within
    one step (the two ropes round differently in float32), and the logits agree closely."""
    require_native_kernels()
    tiny = tiny_hf_model("llama-gqa-llama3rope").path
    sessions = []
    for path in ("native", "torch"):
        session = Session(load(tiny, path, dtype), seed=2, kv_dtype=torch.int8)
        logits, _ = session.forward([random_ids(40, seed=3)], [EMPTY], all_logits=True)
        sessions.append((session.pool, logits))
    (native_pool, native_logits), (torch_pool, torch_logits) = sessions  # the same slots (seed)
    assert native_pool.k_scales is not None and torch_pool.k_scales is not None
    assert native_pool.v_scales is not None and torch_pool.v_scales is not None
    codes = (native_pool.k.int() - torch_pool.k.int()).abs()
    if dtype == "float32":
        assert codes.max() <= 1 and (codes != 0).float().mean() < 1e-3
        assert torch.equal(native_pool.v, torch_pool.v)
        assert torch.equal(native_pool.v_scales, torch_pool.v_scales)
        assert (native_pool.k_scales != torch_pool.k_scales).float().mean() < 1e-2
    tolerance = 1e-3 if dtype == "float32" else 0.1  # bfloat16: roped in bfloat16 on one side
    assert (native_logits - torch_logits).abs().max() <= tolerance


def test_pytorch_path_greedy_outputs_with_and_without_the_cache(
    engine_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PyTorch path over an int8 pool (RADIXLM_NATIVE=0): greedy outputs token for token
    the same with the cache on (cold, then warm) and off; its fresh K/V are attended as the
    pool holds them, so a prompt prefilled whole and one extending a cached prefix agree."""
    from test_engine import shared_prefix_prompts

    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    prompts = shared_prefix_prompts()
    engine = new_engine(engine_model_dir, kv_dtype="int8")
    assert engine.runner.kernels_isa is None and engine.runner.pool.quantized
    reference = outputs(run(new_engine(engine_model_dir, cache="none", kv_dtype="int8"), prompts))
    assert outputs(run(engine, prompts)) == reference
    assert outputs(run(engine, prompts)) == reference  # warm: most prompts hit the cache


def test_runner_builds_the_pool_in_int8_with_its_scales(engine_model_dir: Path) -> None:
    """kv_dtype int8: the engine's pool holds codes and scales, head_dim + 2 bytes a row, and
    hands the scales' addresses to the fused decode step."""
    engine = new_engine(engine_model_dir, num_slots=256, kv_dtype="int8")
    pool = engine.runner.pool
    c = engine.runner.arch
    assert pool.dtype == torch.int8 and pool.quantized
    assert pool.bytes_per_slot == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 2)
    assert np.array_equal(pool.layer_addresses()[:, 2:] != 0, np.ones((c.num_layers, 2), bool))
