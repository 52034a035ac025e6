"""The native kernels equal softmax attention over each request's gathered K/V.

Property-based: random pools, GQA ratios, head sizes with and without a specialised build,
float32 and bfloat16 storage, lengths on and off the kernels' block boundaries. Decode: slot
lists that share leading runs (as the radix tree hands them out) or not, groups larger than the
query block. Extend: several requests in one call, cached prefixes of any length (none included),
new tokens from one to a few tiles. The reference is the textbook formula in float64 over
`k_cache[slots]`; the model-level tests (test_model_numerics.py) check the kernels against
transformers through the whole decoder.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from radixlm.model import native, native_abi, native_build
from radixlm.model.arch import RopeConfig
from radixlm.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from radixlm.model.shared_prefix import find_shared_prefixes

NUM_SLOTS = 4096


def require_native_kernels(isa: str | None = None) -> native.Kernels:
    """The kernels (this process's variant, or `isa`); a test that needs them fails if a C
    compiler exists but they did not build (and is skipped, saying so, only on a machine
    without a compiler)."""
    kernels = native.kernels() if isa is None else native.kernels_for(isa)
    if kernels is None:
        if native_build.compiler() is None:
            pytest.skip("no C compiler: the native kernel cannot be built here")
        pytest.fail(f"a C compiler is present but the {isa or 'native'} kernels did not build")
    return kernels


# Every variant this CPU can execute (native_build.py): an AVX-512 host checks all three.
ISAS = [v.name for v in native_build.executable_variants()]


@pytest.fixture(scope="module", params=ISAS)
def built(request: pytest.FixtureRequest) -> native.Kernels:
    """The kernels of each variant this CPU can execute."""
    return require_native_kernels(request.param)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_lists: list[torch.Tensor]
) -> torch.Tensor:
    """q (B, H, D), k / v (num_slots, KV, D) -> (B, H, D), float64 softmax attention."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    outs = []
    for qi, slots in zip(q.double(), slot_lists):
        ks = k[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (L, H, D)
        vs = v[slots].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", qi, ks) / q.shape[-1] ** 0.5
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), vs))
    return torch.stack(outs).float()


DecodeBatch = tuple[int, int, int, list[torch.Tensor]]  # heads, kv heads, head_dim, slot lists


@st.composite
def decode_batches(draw: st.DrawFn) -> DecodeBatch:
    """(heads, kv_heads, head_dim, slot lists) with some lists sharing a leading run; runs and
    lists up to past a few of the kernel's key segments (SEGMENT, 256 keys)."""
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 3, 4]))
    head_dim = draw(st.sampled_from([64, 16, 32, 128, 80]))
    seed = draw(st.integers(0, 2**31 - 1))
    order = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(seed))
    taken = 0

    def fresh(n: int) -> torch.Tensor:
        nonlocal taken
        assume(taken + n <= NUM_SLOTS)
        taken += n
        return order[taken - n : taken]

    slot_lists = []
    for _ in range(draw(st.integers(1, 4))):  # groups on a common run (a group of 1 = alone)
        run = fresh(draw(st.sampled_from([0, 1, 31, 32, 33, 64, 100, 256, 300, 600])))
        for _ in range(draw(st.integers(1, 5))):
            own = fresh(draw(st.sampled_from([draw(st.integers(1, 70)), 255, 257, 520])))
            slot_lists.append(torch.cat([run, own]))
    return num_heads, num_kv_heads, head_dim, slot_lists


# (queries, K/V): a float32 model over either pool, and a bfloat16 model over its bfloat16 pool
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
BF16_MODEL = (torch.bfloat16, torch.bfloat16)


def check_bf16_dots(kernels: native.Kernels) -> None:
    """The avx512 build uses bfloat16 dot products wherever the CPU has them; no other does."""
    if kernels.isa == "avx512" and "avx512_bf16" in native_build.cpu_flags():
        assert kernels.bf16_dots, "this CPU has AVX512-BF16 but the avx512 build does not use it"
    if kernels.isa != "avx512":
        assert not kernels.bf16_dots


@settings(max_examples=80, deadline=None)
@given(
    batch=decode_batches(),
    threads=st.sampled_from([1, 2]),
    dtypes=st.sampled_from([*DTYPES, BF16_MODEL]),
)
def test_kernel_matches_softmax_attention(
    built: native.Kernels, batch: DecodeBatch, threads: int, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    """float32 queries: float32 arithmetic over float32 or bfloat16 storage; the reference reads
    the same stored values, so both pools meet the float32 tolerance. bfloat16 queries (a
    bfloat16 model): shared runs in bfloat16 dot products where the CPU has them, the output
    rounded to bfloat16."""
    kernels = built
    check_bf16_dots(kernels)
    q_dtype, kv_dtype = dtypes
    num_heads, num_kv_heads, head_dim, slot_lists = batch
    gen = torch.Generator().manual_seed(len(slot_lists))
    k = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(len(slot_lists), num_heads, head_dim, generator=gen) * 3  # peaked softmax
    q = q.to(q_dtype)
    layout = native.DecodeLayout(slot_lists, find_shared_prefixes(slot_lists))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.decode(q, k, v, layout)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == q_dtype
    want = reference(q.float(), k, v, slot_lists)
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:  # bfloat16 output (2^-8 relative) + probabilities rounded to 2^-9 relative
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtypes", [*DTYPES, BF16_MODEL], ids=["f32", "f32-bf16kv", "bf16"])
def test_a_request_gets_the_same_bits_alone_and_in_a_batch(
    built: native.Kernels, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    """Whichever thread takes a task (a (request, kv head) pair, in a dynamic schedule), each
    request's output is bit for bit the same alone or batched."""
    q_dtype, kv_dtype = dtypes
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(NUM_SLOTS, 3, 64, generator=gen).to(kv_dtype)
    v = torch.randn(NUM_SLOTS, 3, 64, generator=gen).to(kv_dtype)
    slot_lists = [torch.randperm(NUM_SLOTS, generator=gen)[: 200 + 37 * i] for i in range(6)]
    q = (torch.randn(6, 9, 64, generator=gen) * 3).to(q_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batched = built.decode(q, k, v, native.DecodeLayout(slot_lists, []))
        for i, slots in enumerate(slot_lists):
            alone = built.decode(q[i : i + 1], k, v, native.DecodeLayout([slots], []))
            assert torch.equal(alone[0], batched[i]), i
    finally:
        torch.set_num_threads(before)


def causal_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, prefix_len: int
) -> torch.Tensor:
    """q (e, H, D) of the new tokens; keys slots (prefix_len + e) -> (e, H, D), float64 math."""
    extend_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    ks = k[slots].double().repeat_interleave(group, dim=1)  # (L, H, D)
    vs = v[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,lhd->hel", q.double(), ks) / head_dim**0.5
    future = torch.arange(len(slots))[None, :] > torch.arange(extend_len)[:, None] + prefix_len
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hel,lhd->ehd", scores.softmax(-1), vs).float()


ExtendBatch = tuple[int, int, int, list[tuple[int, int]]]  # heads, kv heads, head_dim, lengths


@st.composite
def extend_batches(draw: st.DrawFn) -> ExtendBatch:
    """(heads, kv_heads, head_dim, [(prefix_len, extend_len)])."""
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 3, 4]))
    head_dim = draw(st.sampled_from([64, 16, 32, 128, 80]))
    lengths = st.tuples(st.sampled_from([0, 1, 31, 32, 33, 100]), st.integers(1, 80))
    return num_heads, num_kv_heads, head_dim, draw(st.lists(lengths, min_size=1, max_size=4))


Spans = list[tuple[int, int, int, torch.Tensor]]  # (first row, extend_len, prefix_len, slots)


def run_extend(
    kernels: native.Kernels,
    batch: ExtendBatch,
    threads: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, Spans, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random pool and spans for `batch`, and the extend kernel's output over them: (output,
    spans, q, k, v)."""
    num_heads, num_kv_heads, head_dim, lengths = batch
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_SLOTS, generator=gen)
    k = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    total = sum(e for _, e in lengths)
    q = (torch.randn(total, num_heads, head_dim, generator=gen) * 3).to(q_dtype)
    spans, taken, first = [], 0, 0
    for prefix_len, extend_len in lengths:
        slots = order[taken : taken + prefix_len + extend_len]
        spans.append((first, extend_len, prefix_len, slots))
        taken, first = taken + len(slots), first + extend_len
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.extend(q, k, v, native.ExtendLayout(spans))
    finally:
        torch.set_num_threads(before)
    return got, spans, q, k, v


@settings(max_examples=60, deadline=None)
@given(
    batch=extend_batches(),
    threads=st.sampled_from([1, 2]),
    kv_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_extend_kernel_matches_causal_attention(
    built: native.Kernels, batch: ExtendBatch, threads: int, kv_dtype: torch.dtype, seed: int
) -> None:
    """float32 queries: float32 arithmetic over float32 or bfloat16 storage."""
    got, spans, q, k, v = run_extend(built, batch, threads, torch.float32, kv_dtype, seed)
    for first, extend_len, prefix_len, slots in spans:
        want = causal_reference(q[first : first + extend_len], k, v, slots, prefix_len)
        torch.testing.assert_close(got[first : first + extend_len], want, atol=2e-5, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(batch=extend_batches(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_extend_bfloat16_model_matches_causal_attention(
    built: native.Kernels, batch: ExtendBatch, threads: int, seed: int
) -> None:
    """A bfloat16 model over a bfloat16 pool: bfloat16 dot products where the CPU has them
    (the probabilities rounded to bfloat16), float32 arithmetic where not; bfloat16 out."""
    check_bf16_dots(built)
    got, spans, q, k, v = run_extend(built, batch, threads, torch.bfloat16, torch.bfloat16, seed)
    assert got.dtype == torch.bfloat16
    for first, extend_len, prefix_len, slots in spans:
        want = causal_reference(q[first : first + extend_len].float(), k, v, slots, prefix_len)
        # bfloat16 output (2^-8 relative) + probabilities rounded to 2^-9 relative
        torch.testing.assert_close(
            got[first : first + extend_len].float(), want, atol=2e-2, rtol=1e-2
        )


@pytest.mark.parametrize("dtypes", [*DTYPES, BF16_MODEL], ids=["f32", "f32-kv-bf16", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 100])
def test_rope_store_matches_pytorch(
    built: native.Kernels, dtypes: tuple[torch.dtype, torch.dtype], num_tokens: int
) -> None:
    """One call = split + rope on q and k + the K/V write into the pool, in float32 arithmetic
    whatever qkv's dtype; bfloat16 results round like PyTorch's cast (to nearest even)."""
    kernels = built
    qkv_dtype, kv_dtype = dtypes
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(qkv_dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    rope = rope_cos_sin(positions, inverse_frequencies(RopeConfig(), head_dim), torch.float32)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    pools = [torch.zeros(2, NUM_SLOTS, num_kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    q = kernels.rope_store(qkv, rope, slots, pools[0][0], pools[0][1], num_heads)
    assert q.dtype == qkv_dtype
    split = [num_heads * head_dim, *[num_kv_heads * head_dim] * 2]
    want_q, k, v = qkv.float().split(split, dim=-1)
    want_q = apply_rope(want_q.view(num_tokens, num_heads, head_dim), *rope)
    k = apply_rope(k.view(num_tokens, num_kv_heads, head_dim), *rope)
    pools[1][0].index_copy_(0, slots, k.to(kv_dtype))
    pools[1][1].index_copy_(0, slots, v.reshape(num_tokens, num_kv_heads, head_dim).to(kv_dtype))
    if qkv_dtype == torch.float32:
        torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    else:  # one bfloat16 rounding of the float32 result
        torch.testing.assert_close(q.float(), want_q, atol=1e-2, rtol=1e-2)
    if kv_dtype == torch.float32:
        torch.testing.assert_close(pools[0], pools[1], atol=1e-6, rtol=1e-6)
    else:  # rounding of a value within 1e-6 of a tie could differ; v is copied, so exact
        assert torch.equal(pools[0][1], pools[1][1])
        torch.testing.assert_close(pools[0][0], pools[1][0], atol=1e-2, rtol=1e-2)


def test_shared_runs_become_units() -> None:
    """Requests on one run form one unit that reads it once; the others are units of their own."""
    run = torch.arange(100, 150)
    lists = [torch.cat([run, torch.tensor([1, 2])]), torch.arange(200, 240)]
    lists.append(torch.cat([run, torch.tensor([3])]))
    layout = native.DecodeLayout(lists, find_shared_prefixes(lists))
    assert layout.num_units == 2
    assert layout.units.tolist() == [0, 2, 3]
    assert layout.member_row.tolist() == [0, 2, 1]
    assert layout.shared.tolist() == [[0, 50], [53, 0]]  # the run once, then the loner
    assert layout.own.tolist() == [[50, 2], [52, 1], [53, 40]]
    assert layout.slots[:50].tolist() == run.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_major_pool_views_give_the_same_bits(dtype: torch.dtype) -> None:
    """The kernels read and write a head-major pool layer (KVPool on CPU: a strided view) as
    they do a slot-major one: the same outputs, bit for bit, and the same K/V written."""
    kernels = require_native_kernels()
    gen = torch.Generator().manual_seed(3)
    num_slots, num_kv_heads, num_heads, head_dim = 90, 2, 6, 32
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)

    def head_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, (kv, slots) storage

    layouts = [(k, v), (head_major(k), head_major(v))]
    assert not layouts[1][0].is_contiguous()
    slots = torch.randperm(num_slots, generator=gen)[:40]
    q = torch.randn(3, num_heads, head_dim, generator=gen).to(dtype)
    decode = native.DecodeLayout([slots[:30], slots[:25], slots[30:]], [([0, 1], 20)])
    outs = [kernels.decode(q, kc, vc, decode) for kc, vc in layouts]
    assert torch.equal(outs[0], outs[1])
    qe = torch.randn(12, num_heads, head_dim, generator=gen).to(dtype)
    extend = native.ExtendLayout([(0, 7, 13, slots[:20]), (7, 5, 0, slots[20:25])])
    outs = [kernels.extend(qe, kc, vc, extend) for kc, vc in layouts]
    assert torch.equal(outs[0], outs[1])
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    rope = (torch.rand(4, 1, head_dim, generator=gen), torch.rand(4, 1, head_dim, generator=gen))
    new_slots = slots[-4:]
    before = k.clone()
    outs = [kernels.rope_store(qkv, rope, new_slots, kc, vc, num_heads) for kc, vc in layouts]
    assert not torch.equal(k[new_slots], before[new_slots])  # written
    assert torch.equal(k[slots[:-4]], before[slots[:-4]])  # and nothing else
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(layouts[0][0], layouts[1][0]) and torch.equal(layouts[0][1], layouts[1][1])


def test_bad_inputs_are_refused() -> None:
    kernels = require_native_kernels()
    k = torch.zeros(8, 2, 16)
    layout = native.DecodeLayout([torch.arange(3)], [])
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        kernels.decode(torch.zeros(1, 4, 16), k.double(), k.double(), layout)
    with pytest.raises(ValueError, match="need their scales"):
        kernels.decode(torch.zeros(1, 4, 16), k.to(torch.int8), k.to(torch.int8), layout)
    with pytest.raises(ValueError, match="slot- or head-major"):
        kernels.decode(torch.zeros(1, 4, 16), k[::2], k[::2], layout)
    with pytest.raises(ValueError, match="strides"):  # K and V laid out differently
        kernels.decode(
            torch.zeros(1, 4, 16), k, k.transpose(0, 1).contiguous().transpose(0, 1), layout
        )
    with pytest.raises(ValueError, match="do not divide"):
        kernels.decode(torch.zeros(1, 3, 16), k, k, layout)
    spans = native.ExtendLayout([(0, 2, 1, torch.arange(3))])
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.extend(torch.zeros(2, 4, 8), torch.zeros(8, 2, 8), torch.zeros(8, 2, 8), spans)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.decode(torch.zeros(1, 4, 24), torch.zeros(8, 2, 24), torch.zeros(8, 2, 24), layout)


def test_bfloat16_queries_come_back_bfloat16() -> None:
    kernels = require_native_kernels()
    k = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 16, dtype=torch.bfloat16)
    layout = native.DecodeLayout([torch.arange(5)], [])
    got = kernels.decode(q, k, k, layout)
    assert got.dtype == torch.bfloat16
    want = reference(q.float(), k, k, [torch.arange(5)])
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_a_failed_build_falls_back_to_pytorch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails: no kernels, an error naming the variant and the compiler, and
    no exception."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    native.kernels_for.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="radixlm.model.native"):
            assert native.kernels_for("generic") is None
        assert "generic native kernels failed to build" in caplog.text
        assert "false" in caplog.text
        assert any(r.levelno == logging.ERROR for r in caplog.records)
    finally:
        monkeypatch.undo()
        native.kernels_for.cache_clear()


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    assert native.kernels() is None


def test_isa_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXLM_ISA picks any variant the CPU executes, and refuses, saying why, one it cannot
    or one that does not exist."""
    for isa in ISAS:
        monkeypatch.setenv("RADIXLM_ISA", isa)
        assert native_build.chosen_variant().name == isa
        assert require_native_kernels().isa == isa
    monkeypatch.setenv("RADIXLM_ISA", "avx1024")
    with pytest.raises(ValueError, match="not one of"):
        native.kernels()
    foreign = [v for v in native_build.VARIANTS if v not in ISAS]
    if foreign:  # an AVX2-only host refuses avx512
        monkeypatch.setenv("RADIXLM_ISA", foreign[0])
        with pytest.raises(ValueError, match="cannot execute it"):
            native.kernels()


def test_the_best_variant_runs_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXLM_ISA", raising=False)
    assert native_build.chosen_variant().name == ISAS[0]
    assert native_build.GENERIC.name in ISAS  # the portable build runs anywhere


def test_a_refused_variant_names_what_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AVX2 but no AVX-512 (pretended here), avx2 runs and avx512 is refused."""
    avx2_only = native_build.AVX2.needs | {"sse2"}
    monkeypatch.setattr(native_build, "cpu_flags", lambda: avx2_only)
    monkeypatch.setattr(native_build, "X86", True)
    monkeypatch.delenv("RADIXLM_ISA", raising=False)
    assert [v.name for v in native_build.executable_variants()] == ["avx2", "generic"]
    assert native_build.chosen_variant() is native_build.AVX2
    monkeypatch.setenv("RADIXLM_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks avx512bw, avx512cd, avx512dq, avx512f"):
        native_build.chosen_variant()


def test_a_nonzero_status_raises_naming_the_function() -> None:
    """The status check is attached once, to every function (native_abi.errcheck)."""
    kernels = require_native_kernels()
    x = torch.zeros(0, 16)
    with pytest.raises(native_abi.NativeError, match="skinny_linear failed"):
        kernels._fn["skinny_linear"](
            x=x.data_ptr(), wp=x.data_ptr(), y=x.data_ptr(), M=0, N=16, K=16, bf16=0,
            num_threads=1,
        )  # fmt: skip
    with pytest.raises(TypeError, match="missing"):
        kernels._fn["skinny_linear"](x=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 100])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_pytorch(
    built: native.Kernels, dtype: torch.dtype, num_tokens: int, with_delta: bool
) -> None:
    """h += delta in place, then F.rms_norm(h) * weight; bfloat16 rounds h after the add (as
    `h + delta` would) and the output once (PyTorch also computes its norm in float32)."""
    gen = torch.Generator().manual_seed(num_tokens)
    h = (torch.randn(num_tokens, 96, generator=gen) * 4).to(dtype)
    delta = torch.randn(num_tokens, 96, generator=gen).to(dtype) if with_delta else None
    weight = torch.randn(96, generator=gen).to(dtype)
    want_h = h + delta if delta is not None else h.clone()
    want = F.rms_norm(want_h.float(), (96,), weight.float(), 1e-5)
    got = built.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, want_h) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_add_rms_norm_refuses_mixed_inputs() -> None:
    kernels = require_native_kernels()
    h, w = torch.zeros(2, 16), torch.ones(16)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.add_rms_norm(h, torch.zeros(2, 16, dtype=torch.bfloat16), w, 1e-5)
    with pytest.raises(ValueError, match="shapes"):
        kernels.add_rms_norm(h, None, torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 100])
def test_silu_mul_matches_pytorch(
    built: native.Kernels, dtype: torch.dtype, num_tokens: int
) -> None:
    """silu(gate) * up from the stacked gate_up rows, float32 arithmetic, one rounding."""
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up = (torch.randn(num_tokens, 2 * 48, generator=gen) * 4).to(dtype)
    gate, up = gate_up.float().split(48, dim=-1)
    got = built.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (num_tokens, 48)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=tolerance, rtol=tolerance)
    with pytest.raises(ValueError, match="contiguous"):
        built.silu_mul(gate_up[:, :95])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.one_of(st.integers(1, native.SKINNY_MAX_ROWS), st.integers(17, 300)),
    blocks=st.integers(1, 7),
    half_k=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_skinny_linear_matches_f_linear(
    built: native.Kernels,
    rows: int,
    blocks: int,
    half_k: int,
    dtype: torch.dtype,
    threads: int,
    seed: int,
) -> None:
    """x W^T from the packed weight, streamed (decode-sized batches) or in register tiles (more
    rows: slabs of 96, tiles of 8 rows x 3 column blocks, and their remainders): float32 to
    float32 rounding; bfloat16 to one rounding of the float32 result (AVX512-BF16 dot products
    or widened pairs)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16 * blocks, 2 * half_k, generator=gen).to(dtype)
    x = torch.randn(rows, 2 * half_k, generator=gen).to(dtype)
    packed = native.pack_skinny(weight)
    assert packed is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = built.skinny_linear(x, packed)
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.double(), weight.double())
    assert got.dtype == dtype and got.shape == (rows, 16 * blocks)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=8e-3)


def test_skinny_linear_refuses_what_it_cannot_do() -> None:
    kernels = require_native_kernels()
    assert native.pack_skinny(torch.zeros(24, 8)) is None  # out not a multiple of 16
    assert native.pack_skinny(torch.zeros(16, 7)) is None  # in odd
    assert native.pack_skinny(torch.zeros(16, 8, dtype=torch.float16)) is None
    packed = native.pack_skinny(torch.zeros(16, 8))
    assert packed is not None
    with pytest.raises(ValueError, match="skinny_linear"):
        kernels.skinny_linear(torch.zeros(0, 8), packed)
    with pytest.raises(ValueError, match="skinny_linear"):
        kernels.skinny_linear(torch.zeros(2, 10), packed)
    with pytest.raises(ValueError, match="dtype"):
        kernels.skinny_linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed)


@pytest.mark.parametrize("isa", ISAS)
def test_each_matmul_goes_to_the_faster_path(isa: str) -> None:
    """Decode batches always go native; prefill chunks go to oneDNN where it packed the weight,
    but on avx512 and avx2 (whose tiles match or beat it)."""
    kernels = require_native_kernels(isa)
    assert kernels.runs_linear(native.NATIVE_LINEAR_ROWS, onednn_packed=True)
    assert kernels.runs_linear(512, onednn_packed=False)  # nothing else would be fast
    assert kernels.runs_linear(512, onednn_packed=True) == (isa in ("avx512", "avx2"))


def test_the_install_step_fails_loudly_on_a_broken_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m radixlm.model.native_build` (make's install step): a variant that does not
    compile is a nonzero exit naming it; no compiler at all is a warning and exit 0 (the
    kernels are then off, not broken)."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert native_build.main(["generic"]) == 1
    assert "the generic native kernels failed to build" in capsys.readouterr().err
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert native_build.main([]) == 0
    assert not list(tmp_path.glob("*.so"))  # nothing was built


def test_loading_the_kernels_leaves_denormals_alone() -> None:
    """The libraries are linked without -ffast-math's startup code, so loading them does not
    switch this process to flush-to-zero: a float32 denormal survives arithmetic, in this
    thread and in one started after the load."""
    for isa in ISAS:
        require_native_kernels(isa)
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # below float32's smallest normal
    assert (tiny * 2).item() > 0
    assert float("1e-310") * 1.5 > 0  # float64, through the interpreter's own SSE code
    seen: list[float] = []
    worker = threading.Thread(target=lambda: seen.append((tiny * 2).item()))
    worker.start()
    worker.join()
    assert seen[0] > 0


# What a build may not contain, so that it runs on a CPU with only its own features: an
# AVX-512 host executes any of them, so only the instructions themselves can show that the
# avx2 build would run on an AVX2-only CPU. Registers zmm, k0-7 and xmm/ymm16-31 exist only
# under AVX-512 (EVEX encoding), as do these mnemonics; the generic build has no VEX at all
# (no mnemonic starting with v, no ymm).
_AVX512_ONLY = re.compile(
    r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|^(vpternlog|vscalef|vrndscale|vdpbf16|"
    r"vcvtne2ps2bf16|vpermt2|vpcompress|kmov)"
)
_FORBIDDEN = {"avx2": _AVX512_ONLY, "generic": re.compile(r"%[yz]mm|^v")}


@pytest.mark.parametrize("isa", [i for i in ISAS if i in _FORBIDDEN])
def test_a_build_holds_no_instruction_above_its_set(isa: str) -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) to disassemble the library")
    require_native_kernels(isa)
    path = native_build.find_library(native_build.VARIANTS[isa])
    assert path is not None
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True
    ).stdout
    # instruction lines read "  addr:<TAB>mnemonic operands"
    instructions = [line.split("\t", 1)[1] for line in listing.splitlines() if ":\t" in line]
    assert len(instructions) > 1000  # really disassembled
    offending = [ins for ins in instructions if _FORBIDDEN[isa].search(ins)]
    assert offending == [], offending[:5]
