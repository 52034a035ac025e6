"""The int8 K/V format (cache/kv_quant.py) and the native kernels over it, on every variant.

Tolerances, from the format: a stored value is code * scale, exact in float32, within scale / 2
of what was written (scale = max|x| / 127 rounded up to a bfloat16, so < max|x| / 127 *
(1 + 2^-7)). Hence two references:
  - float64 attention over the *dequantized* K/V: the kernels do float32 arithmetic on exactly
    those values, so the float32 pools' tolerance holds (atol 2e-5, rtol 1e-4; a bfloat16
    model's output: one bfloat16 rounding, 1e-2);
  - float64 attention over the K/V *before* quantization: every score moves by at most
    eps = max_j |q . (k'_j - k_j)| / sqrt(D), so each probability by a factor within
    e^(+-2 eps) and the output by at most max|V' - V| + (e^(2 eps) - 1) max|V|.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_kernel import (
    ISAS,
    NUM_SLOTS,
    causal_reference,
    decode_batches,
    extend_batches,
    reference,
    require_native_kernels,
)

from radixlm.cache import kv_quant
from radixlm.cache.kv_pool import KVPool, KVScales
from radixlm.model import native
from radixlm.model.arch import RopeConfig
from radixlm.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from radixlm.model.shared_prefix import find_shared_prefixes


@pytest.fixture(scope="module", params=ISAS)
def built(request) -> native.Kernels:  # type: ignore[no-untyped-def]
    """The kernels of each variant this CPU can execute."""
    return require_native_kernels(request.param)


def int8_pool(
    num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, KVScales, torch.Tensor, torch.Tensor]:
    """(K codes, V codes, their scales, the float K, V they came from): a random layer."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen)
    (kc, ks), (vc, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    return kc, vc, KVScales(ks, vs), k, v


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_stored_value_is_within_half_a_step_of_what_was_written() -> None:
    """The scale is max|x| / 127 rounded up to a bfloat16; codes stay in [-127, 127]; the
    dequantized value is exact in float32 and within scale / 2 of x; zeros stay zeros."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, 64, generator=gen) * torch.logspace(-30, 30, 500)[:, None, None]
    x[7, 1] = 0.0
    codes, scales = kv_quant.quantize(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert codes.shape == x.shape and scales.shape == x.shape[:-1]
    amax = x.abs().amax(-1).double()
    s = scales.double()
    assert (s * 127 >= amax * (1 - 1e-6)).all() and (s * 127 <= amax * (1 + 2**-7)).all()
    assert codes.abs().max() <= 127
    assert codes.abs().amax(-1)[amax > 0].min() >= 126  # the range is used
    values = kv_quant.dequantize(codes, scales)
    assert torch.equal(values.double(), codes.double() * s[..., None])  # exact in float32
    error = (values.double() - x.double()).abs()
    assert (error <= s[..., None] * (0.5 + 2**-16)).all()
    assert scales[7, 1] == 0 and not codes[7, 1].any()


def test_an_int8_pool_holds_about_twice_the_tokens_of_bfloat16_in_the_same_bytes() -> None:
    """A token's row costs head_dim + 2 bytes (codes and a bfloat16 scale) against 2 head_dim:
    at the default model's head_dim of 64, 1.94x the tokens for the same bytes."""
    args = (30, 3, 64)  # the default model's layers, kv heads, head_dim
    bf16, int8 = KVPool(64, *args, torch.bfloat16), KVPool(64, *args, torch.int8)
    assert int8.bytes_per_slot == 2 * 30 * 3 * (64 + 2) and bf16.bytes_per_slot == 2 * 30 * 3 * 128
    held = sum(t.numel() * t.element_size() for t in (int8.k, int8.v, int8.k_scales, int8.v_scales)
               if t is not None)  # fmt: skip
    assert held == 64 * int8.bytes_per_slot
    assert bf16.bytes_per_slot / int8.bytes_per_slot == pytest.approx(128 / 66)
    layer = int8.layer(2)
    assert layer.scales is not None and layer.scales.k.shape == (64, 3)
    assert layer.k.dtype == torch.int8 and int8.scale_strides() == (1, 64)  # head-major
    assert bf16.layer(0).scales is None and bf16.scale_strides() == (0, 0)


def test_copy_slots_moves_codes_and_scales() -> None:
    pool = KVPool(16, 2, 2, 16, torch.int8)
    src, dst = pool.alloc(3), pool.alloc(3)
    for t in (pool.k, pool.v):
        t.random_(-127, 128)
    for scales in (pool.k_scales, pool.v_scales):
        assert scales is not None
        scales.uniform_()
    pool.copy_slots(dst, src)
    for i in range(2):
        layer = pool.layer(i)
        assert layer.scales is not None
        for t in (layer.k, layer.v, *layer.scales):
            assert torch.equal(t[torch.from_numpy(dst)], t[torch.from_numpy(src)])


@settings(max_examples=60, deadline=None)
@given(
    batch=decode_batches(),
    threads=st.sampled_from([1, 2]),
    q_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_decode_over_int8_kv_matches_attention_over_its_values(
    built: native.Kernels, batch: Any, threads: int, q_dtype: torch.dtype
) -> None:
    """Decode (shared runs in tiles or row by row, own slots row by row) over int8 codes: the
    float32 tolerance against the dequantized K/V, the derived bound against the originals."""
    num_heads, num_kv_heads, head_dim, slot_lists = batch
    kc, vc, scales, k, v = int8_pool(num_kv_heads, head_dim, len(slot_lists))
    gen = torch.Generator().manual_seed(len(slot_lists) + 1)
    q = (torch.randn(len(slot_lists), num_heads, head_dim, generator=gen) * 3).to(q_dtype)
    layout = native.DecodeLayout(slot_lists, find_shared_prefixes(slot_lists))
    with num_threads(threads):
        got = built.decode(q, kc, vc, layout, scales)
    assert got.dtype == q_dtype
    kd, vd = kv_quant.dequantize(kc, scales.k), kv_quant.dequantize(vc, scales.v)
    want = reference(q.float(), kd, vd, slot_lists)
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:  # one bfloat16 rounding of the output
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    for i, slots in enumerate(slot_lists):  # against the K/V before quantization
        bound = quantization_bound(q[i].float(), k[slots], v[slots], kd[slots], vd[slots])
        exact = reference(q[i : i + 1].float(), k, v, [slots])[0]
        assert (
            (got[i].float() - exact).abs() <= bound[:, None] + 1e-2 * (q_dtype != torch.float32)
        ).all()


def quantization_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor
) -> torch.Tensor:
    """Per query head: max|V' - V| + (e^(2 eps) - 1) max|V| (the module's bound). q (H, D);
    k, v, kd, vd (L, KV, D), before and after quantization."""
    group = q.shape[0] // k.shape[1]
    dk = (kd - k).double().repeat_interleave(group, dim=1)  # (L, H, D)
    eps = torch.einsum("hd,lhd->hl", q.double(), dk).abs().amax(-1) / q.shape[-1] ** 0.5  # (H,)
    dv = (vd - v).double().abs().amax(dim=(0, 2)).repeat_interleave(group)  # (H,)
    vmax = vd.double().abs().amax(dim=(0, 2)).repeat_interleave(group)
    return (dv + torch.expm1(2 * eps) * vmax).float() * (1 + 1e-5) + 1e-5


@settings(max_examples=40, deadline=None)
@given(batch=extend_batches(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_extend_over_int8_kv_matches_causal_attention_over_its_values(
    built: native.Kernels, batch: Any, threads: int, seed: int
) -> None:
    """Prefill tiles over int8 codes (dequantized as each key block is staged): the float32
    tolerance against causal attention over the dequantized K/V."""
    num_heads, num_kv_heads, head_dim, lengths = batch
    kc, vc, scales, _, _ = int8_pool(num_kv_heads, head_dim, seed % 1000)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_SLOTS, generator=gen)
    q = torch.randn(sum(e for _, e in lengths), num_heads, head_dim, generator=gen) * 3
    spans, taken, first = [], 0, 0
    for prefix_len, extend_len in lengths:
        spans.append(
            (first, extend_len, prefix_len, order[taken : taken + prefix_len + extend_len])
        )
        taken, first = taken + prefix_len + extend_len, first + extend_len
    with num_threads(threads):
        got = built.extend(q, kc, vc, native.ExtendLayout(spans), scales)
    kd, vd = kv_quant.dequantize(kc, scales.k), kv_quant.dequantize(vc, scales.v)
    for first, extend_len, prefix_len, slots in spans:
        want = causal_reference(q[first : first + extend_len], kd, vd, slots, prefix_len)
        torch.testing.assert_close(got[first : first + extend_len], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 100])
def test_rope_store_quantizes_as_the_pytorch_format_does(built, qkv_dtype, num_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """rope_store into an int8 pool writes, at each new token's slot, the codes and scales
    kv_quant.quantize gives for PyTorch's rope of the same k and for v: the same bits (a K code
    may differ by one where the two ropes' float32 roundings straddle a rounding boundary)."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 4
    qkv = qkv.to(qkv_dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    rope = rope_cos_sin(positions, inverse_frequencies(RopeConfig(), head_dim), torch.float32)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    pool = KVPool(NUM_SLOTS, 1, num_kv_heads, head_dim, torch.int8)
    layer = pool.layer(0)
    assert layer.scales is not None
    q = built.rope_store(qkv, rope, slots, layer.k, layer.v, num_heads, layer.scales)
    _, k, v = qkv.float().split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    want_q = apply_rope(
        qkv.float()[:, : num_heads * head_dim].view(num_tokens, num_heads, -1), *rope
    )
    torch.testing.assert_close(
        q.float(), want_q, atol=1e-2 if qkv_dtype != torch.float32 else 1e-6, rtol=1e-2
    )
    v_codes, v_scales = kv_quant.quantize(v.reshape(num_tokens, num_kv_heads, head_dim))
    assert torch.equal(layer.v[slots], v_codes) and torch.equal(layer.scales.v[slots], v_scales)
    k_codes, k_scales = kv_quant.quantize(apply_rope(k.view(num_tokens, num_kv_heads, -1), *rope))
    assert torch.equal(layer.scales.k[slots], k_scales)
    differ = layer.k[slots].int() - k_codes.int()
    assert differ.abs().max() <= 1 and (differ != 0).float().mean() < 1e-3
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[slots] = False
    assert not layer.k[others].any() and not layer.scales.v[others].any()  # nothing else written


def test_a_request_gets_the_same_bits_alone_and_in_a_batch(built) -> None:  # type: ignore[no-untyped-def]
    """Over int8 K/V as over float ones: each request's decode output is bit for bit the same
    alone or batched, however the tasks split."""
    kc, vc, scales, _, _ = int8_pool(3, 64, 11)
    gen = torch.Generator().manual_seed(11)
    slot_lists = [torch.randperm(NUM_SLOTS, generator=gen)[: 200 + 37 * i] for i in range(6)]
    q = torch.randn(6, 9, 64, generator=gen) * 3
    with num_threads(2):
        batched = built.decode(q, kc, vc, native.DecodeLayout(slot_lists, []), scales)
        for i, slots in enumerate(slot_lists):
            alone = built.decode(q[i : i + 1], kc, vc, native.DecodeLayout([slots], []), scales)
            assert torch.equal(alone[0], batched[i]), i


def test_head_major_int8_views_give_the_same_bits() -> None:
    """The kernels read and write an int8 pool's head-major layer (KVPool on CPU: codes and
    scales both strided views) as a slot-major one: the same outputs and the same bytes."""
    kernels = require_native_kernels()
    kc, vc, scales, _, _ = int8_pool(2, 32, 3)
    kc, vc, sk, sv = kc[:90], vc[:90], scales.k[:90], scales.v[:90]

    def head_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    hk, hv, hsk, hsv = (head_major(t) for t in (kc, vc, sk, sv))
    layouts = [(kc, vc, KVScales(sk, sv)), (hk, hv, KVScales(hsk, hsv))]
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(90, generator=gen)[:40]
    q = torch.randn(3, 6, 32, generator=gen)
    decode = native.DecodeLayout([slots[:30], slots[:25], slots[30:]], [([0, 1], 20)])
    outs = [kernels.decode(q, k, v, decode, s) for k, v, s in layouts]
    assert torch.equal(outs[0], outs[1])
    extend = native.ExtendLayout([(0, 7, 13, slots[:20]), (7, 5, 0, slots[20:25])])
    qe = torch.randn(12, 6, 32, generator=gen)
    outs = [kernels.extend(qe, k, v, extend, s) for k, v, s in layouts]
    assert torch.equal(outs[0], outs[1])
    qkv = torch.randn(4, (6 + 4) * 32, generator=gen)
    rope = (torch.rand(4, 1, 32, generator=gen), torch.rand(4, 1, 32, generator=gen))
    for k, v, s in layouts:
        kernels.rope_store(qkv, rope, slots[-4:], k, v, 6, s)
    for a, b in zip((*layouts[0][:2], *layouts[0][2]), (*layouts[1][:2], *layouts[1][2])):
        assert torch.equal(a, b)


def test_int8_kv_without_its_scales_is_refused() -> None:
    kernels = require_native_kernels()
    kc, vc, scales, _, _ = int8_pool(2, 16, 0)
    layout = native.DecodeLayout([torch.arange(3)], [])
    with pytest.raises(ValueError, match="need their scales"):
        kernels.decode(torch.zeros(1, 4, 16), kc, vc, layout)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.decode(
            torch.zeros(1, 4, 16), kc, vc, layout, KVScales(*(s.float() for s in scales))
        )
    with pytest.raises(ValueError, match="scales shaped"):
        kernels.decode(torch.zeros(1, 4, 16), kc, vc, layout, KVScales(scales.k[:5], scales.v[:5]))
