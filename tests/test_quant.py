"""Quantized weights: GGUF blocks decode to what the gguf package dequantizes, the kernels'
records hold them without loss, the integer kernels equal their PyTorch reference on every
variant the CPU runs (rows alone give the bits of rows batched), and a quantized model runs
as the float model on the dequantized weights: exact mode within float rounding, fast mode
within a bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import pytest
import torch
from helpers import TinyModels
from test_native_kernel import ISAS, require_native_kernels

from radixlm.bench.random_gguf import SHAPES, random_tensor, write
from radixlm.cache.kv_pool import KVPool
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import load_causal_lm
from radixlm.model.quant import (
    MODES,
    QUANT_TYPES,
    FileBlocks,
    QuantWeight,
    decode,
    layout,
    quantize_q8_0,
    reference,
)  # fmt: skip
from radixlm.model.transformer import CausalLM, Linear

T = gguf.GGMLQuantizationType
TYPES = [gguf.GGMLQuantizationType[name] for name in QUANT_TYPES]


def qkv_proj(model: CausalLM, layer: int) -> Linear:
    """Layer `layer`'s stacked q/k/v projection (nn.ModuleList items are typed as Module)."""
    proj = cast(Any, model.model.layers[layer]).self_attn.qkv_proj
    assert isinstance(proj, Linear)
    return proj


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    return random_tensor(rows, cols, qtype, np.random.default_rng(seed))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_decode_to_what_gguf_dequantizes(qtype: T) -> None:
    """scale * q + min, from the decoded blocks, is the gguf package's float weight exactly."""
    raw = random_blocks(qtype, 16, 512, seed=1)
    blocks = decode(raw, qtype, (16, 512))
    expected = gguf.quants.dequantize(raw, qtype).reshape(16, 512)
    assert np.array_equal(blocks.dequantize(), expected)
    assert blocks.bits == {T.Q8_0: 8, T.Q5_K: 5, T.Q6_K: 6}.get(qtype, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_records_hold_the_blocks_without_loss(qtype: T, mode: str) -> None:
    """Packed into records (in parts, as a fused q/k/v is), every row unpacks to the float
    weight the blocks describe."""
    weight = QuantWeight(256, mode)
    parts = [decode(random_blocks(qtype, n, 256, seed=n), qtype, (n, 256)) for n in (24, 8, 16)]
    start = 0
    for part in parts:
        weight.add(part, start)
        start += part.q.shape[0]
    assert weight.complete(48) and not weight.complete(56)
    expected = np.concatenate([p.dequantize() for p in parts])
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    rows = torch.tensor([47, 0, 30, 24])
    assert torch.equal(weight.dequantize_rows(rows), torch.from_numpy(expected[rows.numpy()]))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != T.Q4_0], ids=lambda t: t.name)
def test_records_stream_about_the_files_bytes(qtype: T) -> None:
    """A weight's records (what a decode step streams) are within 3 % of the file's bytes (the
    K types' d and dmin held once per super-block of 256 inputs, as the file holds them), in
    both numerics' layouts. Q4_0 is the exception: its min -8 d is held as a half of its own."""
    raw = random_blocks(qtype, 16, 512, seed=2)
    blocks = FileBlocks(raw.view(np.uint8), qtype, (16, 512))
    for mode in MODES:
        weight = QuantWeight(512, mode)
        weight.add(blocks, 0)
        assert raw.nbytes <= weight.nbytes <= 1.03 * raw.nbytes


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        QuantWeight(100, "exact")
    with pytest.raises(ValueError, match="numerics"):
        QuantWeight(64, "int4")
    with pytest.raises(ValueError, match="whole groups"):
        QuantWeight(64, "exact").add(quantize_q8_0(np.zeros((12, 64), dtype=np.float32)), 0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_its_reference(isa: str, mode: str, qtype: T) -> None:
    """quant_linear equals the PyTorch reference of its arithmetic (within float32 rounding and
    the odd activation rounded the other way at a tie), for row counts on and off the row tile,
    and each row alone gives the bits it gets in a batch."""
    kernels = require_native_kernels(isa)
    weight = QuantWeight(512, mode)
    weight.add(decode(random_blocks(qtype, 40, 512, seed=3), qtype, (40, 512)), 0)
    weight.add(decode(random_blocks(T.Q8_0, 16, 512, seed=4), T.Q8_0, (16, 512)), 40)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(5))
    got = kernels.quant_linear(x, weight)
    expected = reference.linear(x, weight)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    alone = torch.cat([kernels.quant_linear(x[i : i + 1], weight) for i in range(7)])
    assert torch.equal(got, alone)
    halves = torch.cat([kernels.quant_linear(x[:5], weight), kernels.quant_linear(x[5:], weight)])
    assert torch.equal(got, halves)
    bf16 = kernels.quant_linear(x.bfloat16(), weight)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - reference.linear(x.bfloat16(), weight).float()).abs().max() <= (
        1e-2 * expected.abs().max()
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(isa: str, mode: str, qtype: T) -> None:
    """quant_rows (an embedding lookup in C) gives exactly the rows the gguf package
    dequantizes, in float32, and those rows rounded to bfloat16."""
    kernels = require_native_kernels(isa)
    weight = QuantWeight(256, mode)
    weight.add(decode(random_blocks(qtype, 24, 256, seed=8), qtype, (24, 256)), 0)
    weight.add(decode(random_blocks(T.Q8_0, 8, 256, seed=9), T.Q8_0, (8, 256)), 24)
    ids = torch.tensor([31, 0, 7, 24, 7, 13])
    expected = weight.dequantize_rows(ids)
    assert torch.equal(kernels.quant_rows(ids, weight, torch.float32), expected)
    assert torch.equal(kernels.quant_rows(ids, weight, torch.bfloat16), expected.bfloat16())


def test_kernel_refuses_what_does_not_fit() -> None:
    kernels = require_native_kernels()
    weight = QuantWeight(64, "exact")
    weight.add(quantize_q8_0(np.ones((8, 64), dtype=np.float32)), 0)
    with pytest.raises(ValueError, match="inputs"):
        kernels.quant_linear(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="quant_linear"):
        kernels.quant_linear(torch.zeros(2, 64, dtype=torch.float16), weight)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama in Q4_K_M's mix: Q4_K, with attn_v, ffn_down and the tied embedding Q6_K."""
    path = tmp_path_factory.mktemp("quant") / "tiny-q4_k_m.gguf"
    return write(str(path), SHAPES["tiny"], "Q4_K_M", seed=7, tokenizer_from=None)


def forward_logits(model: CausalLM, ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """All prompt logits, then `steps` greedy decode steps: (logits rows, generated ids)."""
    c = model.config
    pool = KVPool(256, c.num_layers, c.num_kv_heads, c.head_dim)
    slots = pool.alloc(len(ids))
    empty = np.zeros(0, dtype=np.int64)
    rows = [model(ForwardBatch.build([ids], [empty], [slots], all_logits=True), pool)]
    out = [int(rows[0][-1].argmax())]
    for _ in range(steps):
        new = pool.alloc(1)
        rows.append(model(ForwardBatch.build([[out[-1]]], [slots], [new]), pool))
        slots = np.concatenate([slots, new])
        out.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), out


def test_a_quantized_gguf_runs_as_its_dequantized_weights(mixed_gguf: str) -> None:
    """Every matmul of a Q4_K_M file held as blocks (no dense copy), and its logits those of
    the float model on the dequantized weights, within float rounding in exact mode."""
    require_native_kernels()
    exact = load_causal_lm(mixed_gguf, quant="exact")
    float_model = load_causal_lm(mixed_gguf, quant="float")
    linears = [m for m in exact.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None and m.weight.numel() == 0 for m in linears)
    assert exact.model.embed_tokens.quant is exact.lm_head.quant
    qkv = qkv_proj(exact, 0).quant
    assert qkv is not None and [p.source for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert exact.backend.fused is not None  # decode steps run in one native call
    ids = list(range(3, 60, 2))
    got, got_ids = forward_logits(exact, ids, 6)
    expected, expected_ids = forward_logits(float_model, ids, 6)
    assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert got_ids == expected_ids


def test_fused_decode_gives_the_layer_loops_bits(mixed_gguf: str) -> None:
    """A quantized decode step through decode_step.c equals the Python layer loop bit for bit
    (the same kernels in the same order), for a batch of several requests."""
    from dataclasses import replace

    require_native_kernels()
    model = load_causal_lm(mixed_gguf, quant="exact")
    fused = model.backend
    runs = []
    for backend in (fused, replace(fused, fused=None)):
        model.backend = backend
        c = model.config
        pool = KVPool(256, c.num_layers, c.num_kv_heads, c.head_dim)
        prompts = [list(range(5, 20)), list(range(30, 41)), list(range(50, 71))]
        seqs = [pool.alloc(len(p)) for p in prompts]
        empty = [np.zeros(0, dtype=np.int64)] * 3
        model(ForwardBatch.build(prompts, empty, seqs), pool)
        new = [pool.alloc(1) for _ in prompts]
        runs.append(model(ForwardBatch.build([[7], [8], [9]], seqs, new), pool))
    assert torch.equal(runs[0], runs[1])


def test_fast_mode_stays_within_its_bound(mixed_gguf: str) -> None:
    """int8 activations: top-1 agreement and KL against exact mode within llama.cpp-like
    bounds on the same weights."""
    require_native_kernels()
    ids = list(range(3, 200, 3))
    exact, _ = forward_logits(load_causal_lm(mixed_gguf, quant="exact"), ids, 0)
    fast, _ = forward_logits(load_causal_lm(mixed_gguf, quant="fast"), ids, 0)
    p, q = torch.log_softmax(exact, -1), torch.log_softmax(fast, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    agree = (exact.argmax(-1) == fast.argmax(-1)).float().mean()
    assert kl < 0.02 and agree >= 0.9
    assert not torch.equal(exact, fast)  # the modes are different numerics


def test_quantize_q8_0_holds_a_float_checkpoint_as_blocks(tiny_hf_model: TinyModels) -> None:
    """--quantize q8_0: a float checkpoint's linear weights become Q8_0 blocks (where their
    shape fits the kernels) and the logits stay near the float model's."""
    require_native_kernels()
    path = str(tiny_hf_model("llama-gqa-llama3rope").path)
    quantized = load_causal_lm(path, quantize="q8_0")
    plain = load_causal_lm(path)
    linears = [m for m in quantized.modules() if isinstance(m, Linear)]
    assert any(m.quant is not None for m in linears)
    assert all(p.source == "Q8_0" for m in linears if m.quant for p in m.quant.parts)
    ids = list(range(1, 30))
    got, _ = forward_logits(quantized, ids, 0)
    expected, _ = forward_logits(plain, ids, 0)
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()


def test_without_kernels_quantized_weights_are_dequantized(
    mixed_gguf: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the native kernels off (RADIXLM_NATIVE=0) a quantized file loads as floats."""
    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    model = load_causal_lm(mixed_gguf)
    assert all(m.quant is None for m in model.modules() if isinstance(m, Linear))


def test_random_gguf_writes_every_mix(tmp_path: Path) -> None:
    """The benchmark's random files load in every type the kernels keep as blocks."""
    require_native_kernels()
    for kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_K_M"):
        path = write(str(tmp_path / f"{kind}.gguf"), SHAPES["tiny"], kind, tokenizer_from=None)
        model = load_causal_lm(path)
        qkv = qkv_proj(model, 1).quant
        assert qkv is not None and qkv.parts[0].source == kind.removesuffix("_M")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_c_repacker_writes_the_records_numpy_packs(isa: str, mode: str, qtype: T) -> None:
    """A file's blocks repacked in one C pass (with a row order, as llama's q/k rows are) are
    byte for byte the records the numpy path decodes and packs."""
    kernels = require_native_kernels(isa)
    raw = random_blocks(qtype, 32, 512, seed=12)
    order = np.random.default_rng(13).permutation(32)
    for row_order in (None, order):
        blocks = FileBlocks(raw.view(np.uint8), qtype, (32, 512), row_order)
        expected = layout.pack(blocks.decode(), mode)
        assert np.array_equal(kernels.repack_blocks(blocks, mode).numpy(), expected)


def test_a_qwen2_file_with_biases_runs_as_its_dequantized_weights(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases beside quantized q/k/v weights: the layer loop adds them after the
    integer matmul, and the logits are the float model's within float rounding."""
    require_native_kernels()
    path = write(str(tmp_path / "qwen2.gguf"), SHAPES["tiny-qwen2"], "Q4_K_M", seed=3,
                 tokenizer_from=None)  # fmt: skip
    exact = load_causal_lm(path, quant="exact")
    assert exact.config.qkv_bias and qkv_proj(exact, 0).quant is not None
    ids = list(range(5, 40))
    got, got_ids = forward_logits(exact, ids, 4)
    expected, expected_ids = forward_logits(load_causal_lm(path, quant="float"), ids, 4)
    assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert got_ids == expected_ids
