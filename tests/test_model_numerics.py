"""The decoder's logits equal transformers' (fp32, max abs diff <= 1e-4) for every flag combination.

The reference is always one full forward of the transformers model over the whole sequence; the
paths under test (prefill, extend on a cached prefix, decode steps, mixed batches) must produce
the same rows. Slots are handed out in shuffled order, so nothing relies on contiguous KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import TinyModel, TinyModels
from test_native_kernel import ISAS, require_native_kernels

from radixlm.cache.kv_pool import KVPool
from radixlm.config import KVDType, ModelDType
from radixlm.model import native, packed_linear, shared_prefix
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import load_causal_lm
from radixlm.model.shared_prefix import find_shared_prefixes
from radixlm.model.transformer import CausalLM, Linear

TOLERANCE = 1e-4
SEQ_LEN = 24
EMPTY = np.zeros(0, dtype=np.int64)


class Session:
    """Our model plus a pool; remembers each request's slots like a (trivial) prefix cache."""

    def __init__(
        self, model: CausalLM, seed: int = 0, kv_dtype: torch.dtype = torch.float32
    ) -> None:
        c = model.config
        self.model = model
        self.pool = KVPool(512, c.num_layers, c.num_kv_heads, c.head_dim, dtype=kv_dtype)
        self.rng = np.random.default_rng(seed)

    def slots(self, n: int) -> np.ndarray:
        return self.rng.permutation(self.pool.alloc(n))

    def forward(
        self, new_tokens: Sequence[Sequence[int]], prefixes: Sequence[np.ndarray], all_logits: bool
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """One forward; returns logits and each request's slots after it (prefix + new)."""
        new_slots = [self.slots(len(t)) for t in new_tokens]
        batch = ForwardBatch.build(new_tokens, prefixes, new_slots, all_logits=all_logits)
        with torch.inference_mode():
            logits = self.model(batch, self.pool)
        return logits, [np.concatenate([p, n]) for p, n in zip(prefixes, new_slots)]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Compute a prefix into the pool; its slots."""
        if not ids:
            return EMPTY
        _, (slots,) = self.forward([ids], [EMPTY], all_logits=False)
        return slots


def random_ids(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    return torch.randint(
        0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def reference_logits(reference: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[0].float()  # (L, vocab)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e} > {TOLERANCE:.0e}"


@pytest.fixture(params=ISAS, ids=[f"isa-{isa}" for isa in ISAS])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel variant this CPU can execute, forced for the test (RADIXLM_ISA)."""
    monkeypatch.setenv("RADIXLM_ISA", request.param)
    require_native_kernels(request.param)
    return str(request.param)


Variant = tuple[CausalLM, Any]  # our model and the transformers reference


@pytest.fixture(params=[*ISAS, "torch"], ids=[*(f"native-{i}" for i in ISAS), "torch-attention"])
def variant(
    each_tiny_hf_model: TinyModel, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Variant:
    """(our model, the transformers reference), once per flag combination and attention path
    (the native kernels of each variant the CPU executes, reading the pool in place; PyTorch
    SDPA over gathered K/V)."""
    if request.param != "torch":
        monkeypatch.setenv("RADIXLM_ISA", request.param)
        require_native_kernels(request.param)
    model = load_causal_lm(str(each_tiny_hf_model.path))
    if request.param == "torch":
        model.use_kernels(None)  # the PyTorch reference path
    assert model.native_kernels == (request.param != "torch")
    return model, each_tiny_hf_model.reference


def test_full_prefill(variant: Variant) -> None:
    model, reference = variant
    ids = random_ids(SEQ_LEN, seed=1)
    logits, _ = Session(model).forward([ids], [EMPTY], all_logits=True)
    assert_close(logits, reference_logits(reference, ids))


@pytest.mark.parametrize("prefix_len", [0, 1, SEQ_LEN // 2, SEQ_LEN - 1])
def test_extend_on_cached_prefix(variant: Variant, prefix_len: int) -> None:
    model, reference = variant
    ids = random_ids(SEQ_LEN, seed=2)
    session = Session(model)
    prefix = session.prefill(ids[:prefix_len])
    logits, _ = session.forward([ids[prefix_len:]], [prefix], all_logits=True)
    assert_close(logits, reference_logits(reference, ids)[prefix_len:])


def test_decode_steps(variant: Variant) -> None:
    model, reference = variant
    ids = random_ids(SEQ_LEN, seed=3)
    expected = reference_logits(reference, ids)
    session = Session(model)
    slots = session.prefill(ids[:16])
    for pos in range(16, SEQ_LEN):
        logits, (slots,) = session.forward([[ids[pos]]], [slots], all_logits=False)
        assert_close(logits[0], expected[pos])


def test_mixed_batch(variant: Variant) -> None:
    """One extend batch of requests with different lengths and prefixes, then batched decodes."""
    model, reference = variant
    lengths, prefix_lens = [5, 17, 24, 9], [0, 8, 23, 3]
    seqs = [random_ids(n + 3, seed=10 + i) for i, n in enumerate(lengths)]  # +3 decode steps
    expected = [reference_logits(reference, s) for s in seqs]
    session = Session(model)
    prefixes = [session.prefill(s[:p]) for s, p in zip(seqs, prefix_lens)]
    new = [s[p:n] for s, p, n in zip(seqs, prefix_lens, lengths)]
    logits, slots = session.forward(new, prefixes, all_logits=True)
    rows = logits.split([len(t) for t in new])
    for got, want, p, n in zip(rows, expected, prefix_lens, lengths):
        assert_close(got, want[p:n])
    for step in range(3):
        step_tokens = [[s[n + step]] for s, n in zip(seqs, lengths)]
        batch_logits, slots = session.forward(step_tokens, slots, all_logits=False)
        for got, want, n in zip(batch_logits, expected, lengths):
            assert_close(got, want[n + step])


def test_decodes_riding_along_with_a_prefill_chunk(variant: Variant) -> None:
    """A mixed step: one-token requests on a prefix (batched decode rows) between prefills."""
    model, reference = variant
    lengths, prefix_lens = [6, 20, 11, 24, 2], [0, 19, 4, 23, 1]
    seqs = [random_ids(n, seed=30 + i) for i, n in enumerate(lengths)]
    session = Session(model)
    prefixes = [session.prefill(s[:p]) for s, p in zip(seqs, prefix_lens)]
    new = [s[p:] for s, p in zip(seqs, prefix_lens)]
    logits, _ = session.forward(new, prefixes, all_logits=False)
    for got, s in zip(logits, seqs):
        assert_close(got, reference_logits(reference, s)[-1])


@pytest.mark.parametrize("fused", [True, False], ids=["flash-lse", "explicit-lse"])
def test_decode_requests_sharing_prefix_slots(
    variant: Variant, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests on the same cached prefix slots (as the radix tree hands them out): the shared
    run is attended once for the group, the rest per request, and the logits do not move."""
    if not fused:
        monkeypatch.setattr(shared_prefix, "_FLASH_WITH_LSE", None)
    model, reference = variant
    prefix = random_ids(40, seed=40)
    tails = [random_ids(2 + 3 * i, seed=41 + i) for i in range(3)]
    alone = random_ids(45, seed=50)
    session = Session(model)
    shared = session.prefill(prefix)
    _, slots = session.forward([t[:-1] for t in tails], [shared] * 3, all_logits=False)
    alone_slots = session.prefill(alone[:-1])
    steps = [[t[-1]] for t in tails] + [alone[-1:]]
    batch_slots = [*slots, alone_slots]
    split = shared_prefix.plan_shared_decode([torch.from_numpy(s) for s in batch_slots], 1)
    assert split is not None and split.grouped.tolist() == [0, 1, 2]  # the split is taken
    logits, _ = session.forward(steps, batch_slots, all_logits=False)
    for got, ids in zip(logits, [prefix + t for t in tails] + [alone]):
        assert_close(got, reference_logits(reference, ids)[-1])


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bfloat16_kv_decodes_sharing_a_prefix(
    tiny_hf_model: TinyModels, dtype: str, native_kernels: bool
) -> None:
    """A bfloat16 pool (under a bfloat16 or a float32 model): decodes on a shared run, in a pure
    decode step and riding along with a prefill, stay near the float32 reference."""
    tiny = tiny_hf_model("llama-gqa-llama3rope")
    if native_kernels:
        require_native_kernels()
    model = load_causal_lm(str(tiny.path), dtype=dtype)
    if not native_kernels:
        model.use_kernels(None)
    prefix = random_ids(40, seed=60)
    seqs = [prefix + random_ids(4 + i, seed=61 + i) for i in range(3)]
    session = Session(model, kv_dtype=torch.bfloat16)
    shared = session.prefill(prefix)
    _, slots = session.forward([s[40:-2] for s in seqs], [shared] * 3, all_logits=False)
    late = random_ids(9, seed=70)
    steps = [[s[-2]] for s in seqs] + [late]
    rows, slots = session.forward(steps, [*slots, EMPTY], all_logits=False)
    for got, s in zip(rows, seqs):  # a mixed step: three decodes beside a prefill
        assert (got - reference_logits(tiny.reference, s)[-2]).abs().max() < 0.5
    rows, _ = session.forward([[s[-1]] for s in seqs], slots[:3], all_logits=False)
    for got, s in zip(rows, seqs):  # a pure decode step
        assert (got - reference_logits(tiny.reference, s)[-1]).abs().max() < 0.5


@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32-kv", "bf16-kv", "int8-kv"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_step_equals_the_layer_loop(
    tiny_hf_model: TinyModels,
    isa: str,
    dtype: str,
    kv_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pure decode step through FusedDecode (the layer loop in one native call) gives the same
    bits as the Python loop over the same kernels: logits and the K/V it writes, with requests
    on a shared run and one alone, over several steps, and a step of 20 requests."""
    require_native_kernels()
    model = load_causal_lm(str(tiny_hf_model("llama-gqa-llama3rope").path), dtype=dtype)
    fused = model.backend
    assert fused.fused is not None and fused.kernels is not None and fused.kernels.isa == isa
    calls: list[int] = []
    real = native.Kernels.decode_layers

    def counted(self: native.Kernels, *args: Any) -> Any:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(native.Kernels, "decode_layers", counted)
    runs = []
    for fuse in (True, False, True):  # the second fused run on a new pool: no stale pool addresses
        model.backend = fused if fuse else replace(fused, fused=None)
        calls.clear()
        session = Session(model, seed=5, kv_dtype=kv_dtype)
        shared = session.prefill(random_ids(40, seed=80))
        tails = [random_ids(3 + i, seed=81 + i) for i in range(3)]
        _, slots = session.forward(tails, [shared] * 3, all_logits=False)
        slots = [*slots, session.prefill(random_ids(30, seed=90))]
        steps = []
        for step in range(3):
            rows, slots = session.forward([[7 + step + i] for i in range(4)], slots, False)
            steps.append(rows)
        # a step of 20 (more rows than the streamed matmuls take: register tiles)
        slots = [*slots, *(session.prefill(random_ids(5, seed=100 + i)) for i in range(16))]
        rows, _ = session.forward([[9 + i] for i in range(20)], slots, False)
        steps.append(rows)
        pool = session.pool
        kv = [torch.stack([pool.k_cache(i), pool.v_cache(i)]) for i in range(pool.num_layers)]
        scales = [
            torch.stack(list(s)) for i in range(pool.num_layers) if (s := pool.layer(i).scales)
        ]
        kv_and_scales = (torch.stack(kv), torch.stack(scales) if scales else None)
        runs.append((torch.cat(steps), kv_and_scales, len(calls)))
    (loop_logits, loop_kv, loop_calls) = runs[1]
    assert loop_calls == 0
    for fused_logits, fused_kv, fused_calls in (runs[0], runs[2]):
        # the paths compared are the ones meant: the step of 20 fuses where skinny_linear takes
        # 20 rows (not generic's, whose larger steps loop for F.linear)
        assert fused_calls == 3 + (fused.native_linear_rows >= 20)
        assert torch.equal(fused_logits, loop_logits)
        assert torch.equal(fused_kv[0], loop_kv[0])
        if fused_kv[1] is not None:  # int8's scales
            assert loop_kv[1] is not None and torch.equal(fused_kv[1], loop_kv[1])


def test_fused_decode_refuses_what_does_not_fit(tiny_hf_model: TinyModels) -> None:
    """decode_layers checks what it is handed before any native code runs: tables of the wrong
    shape or type, rows the layout does not have, a dtype it does not run, K/V strides of no
    pool layout."""
    require_native_kernels()
    model = load_causal_lm(str(tiny_hf_model("llama-gqa-llama3rope").path))
    fused = model.backend.fused
    assert fused is not None
    session = Session(model)
    slots = [session.prefill(random_ids(6, seed=110 + i)) for i in range(2)]
    layout = native.DecodeLayout([torch.from_numpy(s) for s in slots], [])
    h = torch.zeros(2, model.config.hidden_size)
    rope = (torch.zeros(2, 1, model.config.head_dim), torch.zeros(2, 1, model.config.head_dim))
    out_slots = torch.tensor([0, 1])
    kv = session.pool.layer_addresses()

    def attempt(
        h: torch.Tensor, weights: torch.Tensor, strides: tuple[int, int] = session.pool.kv_strides()
    ) -> None:
        fused.kernels.decode_layers(
            h, weights, kv, strides, fused.final_norm, fused.shape, rope, out_slots,
            torch.float32, layout,
        )  # fmt: skip

    with pytest.raises(ValueError, match="tables"):
        attempt(h, fused.weights[:1])  # one layer's row for a two-layer model
    with pytest.raises(ValueError, match="tables"):
        attempt(h, fused.weights.float())
    with pytest.raises(ValueError, match="layout"):
        attempt(h[:1], fused.weights)  # the layout has two requests
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attempt(h.half(), fused.weights)
    head_dim = model.config.head_dim
    with pytest.raises(ValueError, match="strides"):
        attempt(h, fused.weights, (head_dim, head_dim))  # heads on top of each other


@pytest.mark.parametrize("variant", ["llama-mha-tied-bias", "qwen3-gqa-qknorm"])
def test_fused_decode_is_not_used_where_it_does_not_apply(
    tiny_hf_model: TinyModels, variant: str
) -> None:
    """Biases and q/k norms are not in the native layer loop: those models keep the Python one
    (whose decode steps the reference tests above check)."""
    require_native_kernels()
    model = load_causal_lm(str(tiny_hf_model(variant).path))
    assert model.backend.kernels is not None and model.backend.fused is None


def test_shared_runs_are_found_from_slot_ids() -> None:
    base = torch.arange(100, 200)
    lists = [
        torch.cat([base[:60], torch.tensor([7, 8])]),
        torch.cat([base[:50], torch.tensor([9])]),
        base[:80],
        torch.arange(300, 340),  # shares nothing
    ]
    assert find_shared_prefixes(lists) == [([0, 1, 2], 50)]
    assert find_shared_prefixes(lists[:1] + lists[3:]) == []


def test_decode_batch_with_a_one_token_prompt(variant: Variant) -> None:
    """A decode step may hold a request with nothing cached yet next to a long one."""
    model, reference = variant
    short, long = random_ids(1, seed=20), random_ids(SEQ_LEN, seed=21)
    session = Session(model)
    long_prefix = session.prefill(long[:-1])
    logits, _ = session.forward([short, long[-1:]], [EMPTY, long_prefix], all_logits=False)
    assert_close(logits[0], reference_logits(reference, short)[0])
    assert_close(logits[1], reference_logits(reference, long)[-1])


def test_a_decode_is_one_new_token_over_a_prefix() -> None:
    """ForwardBatch.is_decode, the model's one definition, which attention and the fused decode
    step ask: a one-token prompt with nothing cached is not a decode."""
    decodes = ForwardBatch.build(
        [[1], [2]], [np.arange(3), np.arange(5)], [np.array([7]), np.array([8])]
    )
    assert decodes.is_decode == (True, True) and decodes.is_pure_decode
    mixed = ForwardBatch.build(
        [[1], [2], [3, 4]],
        [EMPTY, np.arange(5), EMPTY],
        [np.array([7]), np.array([8]), np.array([9, 10])],
    )
    assert mixed.is_decode == (False, True, False) and not mixed.is_pure_decode


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["model-kv", "int8-kv"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_with_and_without_the_cache_per_variant(
    isa: str, dtype: ModelDType, kv_dtype: KVDType | None, tmp_path: Path
) -> None:
    """Each kernel variant, end to end through the engine: greedy outputs are token for token
    the same with the radix cache on (twice: cold, then warm) and off, with the pool in the
    model's dtype or in int8 (the same K/V quantized the same way, cached or recomputed)."""
    from helpers import save_tiny_model
    from test_engine import outputs, run, shared_prefix_prompts

    from radixlm.config import CacheConfig, CacheKind, ModelConfig, SchedulerConfig
    from radixlm.engine.engine import Engine

    save_tiny_model("llama-gqa-llama3rope", tmp_path, max_position_embeddings=1024)

    def make(cache: CacheKind) -> Engine:
        model = ModelConfig(path=str(tmp_path), num_threads=1, dtype=dtype)
        cache_config = CacheConfig(num_slots=4096, cache=cache, kv_dtype=kv_dtype)
        return Engine(model, cache_config, SchedulerConfig())

    prompts = shared_prefix_prompts()
    engine = make("radix")
    assert engine.runner.kernels_isa == isa  # what /v1/cache reports as kernels_isa
    reference = outputs(run(make("none"), prompts))
    assert outputs(run(engine, prompts)) == reference
    assert outputs(run(engine, prompts)) == reference  # warm: most prompts hit the cache


def test_bfloat16_runs_where_onednn_cannot_pack_it(
    tiny_hf_model: TinyModels, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where oneDNN refuses to pack bfloat16 weights (a CPU with AVX2 but not AVX-512;
    pretended here), a bfloat16 model still loads and runs: dense weights for F.linear, the
    native kernels' own packing for theirs (the fused decode step included)."""
    real = packed_linear._onednn_pack

    def refuse(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs avx512bw")
        return real(weight)

    monkeypatch.setattr(packed_linear, "_onednn_pack", refuse)
    packed_linear.packs.cache_clear()
    try:
        tiny = tiny_hf_model("llama-gqa-llama3rope")
        model = load_causal_lm(str(tiny.path), dtype="bfloat16")
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and not any(m.weight.is_mkldnn for m in linears)
        assert model.backend.fused is not None
        ids = random_ids(SEQ_LEN, seed=7)
        session = Session(model, kv_dtype=torch.bfloat16)
        logits, (slots,) = session.forward([ids[:-1]], [EMPTY], all_logits=True)
        step, _ = session.forward([ids[-1:]], [slots], all_logits=False)
        want = reference_logits(tiny.reference, ids)
        assert (logits - want[:-1]).abs().max() < 0.5
        assert (step - want[-1:]).abs().max() < 0.5
    finally:
        packed_linear.packs.cache_clear()


def test_the_backend_is_chosen_once_at_load(
    tiny_hf_model: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward never looks the kernels up again: the backend chosen at load runs, and a model
    loaded with RADIXLM_NATIVE=0 stays on the PyTorch path after the variable changes."""
    require_native_kernels()
    tiny = tiny_hf_model("llama-gqa-llama3rope")
    path = str(tiny.path)
    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    reference_path = load_causal_lm(path)
    monkeypatch.delenv("RADIXLM_NATIVE")
    model = load_causal_lm(path)
    assert reference_path.backend.kernels is None and reference_path.backend.fused is None
    assert model.backend.kernels is not None and model.backend.fused is not None

    def refuse() -> None:
        raise AssertionError("a forward chose the kernels again")

    monkeypatch.setattr(native, "kernels", refuse)
    ids = random_ids(SEQ_LEN, seed=4)
    for m in (reference_path, model):
        session = Session(m)
        slots = session.prefill(ids[:-1])
        step, _ = session.forward([ids[-1:]], [slots], all_logits=False)
        assert_close(step[0], reference_logits(tiny.reference, ids)[-1])
