"""A verify chain's rows get, bit for bit, the logits of the decode steps they stand for, and a
decode row gets the same bits alone or batched, whatever the batch shares.

Greedy output is token-identical with speculation on and off only if every verify row equals the
decode step over the same tokens exactly, not to a tolerance, and since the two modes batch
requests differently over time, only if a decode row's bits do not depend on its batch. Checked
on every kernel variant this CPU executes, for quantized blocks (the default numerics) and float
weights in float32 and bfloat16: a chain alone, beside plain decode rows (sharing its prefix or
not), beside another chain and beside a prefill chunk, at prefix lengths on and off the kernel's
key chunks; decode rows on one cached prompt, batched and alone. The decode kernel's rule behind
it (units of fewer than 16 query rows read a common run up to a multiple of 32 keys once and give
each row its lone bits) is checked on the kernel directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import save_tiny_model
from test_native_kernel import ISAS, NUM_SLOTS, require_native_kernels

from radixlm.bench.random_gguf import SHAPES, write
from radixlm.cache.kv_pool import KVPool
from radixlm.model import native
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import load_causal_lm
from radixlm.model.transformer import CausalLM
from radixlm.model.verify_rows import (
    KEY_CHUNK,
    SKINNY_EXACT_ROWS,
    UNBOUNDED,
    exact_rows,
    exact_units,
)

EMPTY = np.zeros(0, dtype=np.int64)
VOCAB = 272  # a multiple of 16: the LM head packs for skinny_linear like every other matmul


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny quantized GGUF (Q4_1 blocks, Q8_0-free) and a tiny float checkpoint."""
    root = tmp_path_factory.mktemp("verify-models")
    gguf = Path(write(str(root / "tiny.gguf"), SHAPES["tiny"], "Q4_1", tokenizer_from=None))
    save_tiny_model(
        "llama-gqa-llama3rope", root / "float", vocab_size=VOCAB, max_position_embeddings=1024
    )
    return {"quant": gguf, "float": root / "float"}


MODELS = [("quant", "float32"), ("quant", "bfloat16"), ("float", "float32"), ("float", "bfloat16")]


@pytest.fixture(params=[(isa, *m) for isa in ISAS for m in MODELS],
                ids=[f"{isa}-{m[0]}-{m[1]}" for isa in ISAS for m in MODELS])  # fmt: skip
def model(request, model_files, monkeypatch) -> CausalLM:  # type: ignore[no-untyped-def]
    isa, kind, dtype = request.param
    monkeypatch.setenv("RADIXLM_ISA", isa)
    require_native_kernels(isa)
    loaded = load_causal_lm(str(model_files[kind]), dtype=dtype)
    assert loaded.backend.kernels is not None and loaded.backend.kernels.isa == isa
    return loaded


class Pool:
    """A pool with shuffled slots, and the logits of one forward."""

    def __init__(self, model: CausalLM) -> None:
        c = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.model = model
        self.pool = KVPool(2048, c.num_layers, c.num_kv_heads, c.head_dim, dtype=dtype)
        self.rng = np.random.default_rng(0)

    def slots(self, n: int) -> np.ndarray:
        return self.rng.permutation(self.pool.alloc(n))

    def forward(
        self,
        tokens: Sequence[Sequence[int]],
        prefixes: Sequence[np.ndarray],
        new: Sequence[np.ndarray],
        verify: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        batch = ForwardBatch.build(tokens, prefixes, new, verify=verify)
        with torch.inference_mode():
            return self.model(batch, self.pool).float()

    def prefill(self, ids: list[int]) -> np.ndarray:
        slots = self.slots(len(ids))
        self.forward([ids], [EMPTY], [slots])
        return slots

    def stepwise(self, prefix: np.ndarray, chain: list[int], slots: np.ndarray) -> torch.Tensor:
        """The chain decoded one token per forward, alone: the reference rows."""
        rows = []
        for j, token in enumerate(chain):
            seen = np.concatenate([prefix, slots[:j]])
            rows.append(self.forward([[token]], [seen], [slots[j : j + 1]])[0])
        return torch.stack(rows)


def ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("prefix_len", [31, 64, 100])
def test_a_chain_alone_gets_the_decode_steps_bits(model: CausalLM, prefix_len: int) -> None:
    """Chains of 2 and of 9 rows (more than one unit of the decode kernel)."""
    pool = Pool(model)
    prefix = pool.prefill(ids(prefix_len, 1))
    for length in (2, 9):
        chain, slots = ids(length, 2), pool.slots(length)
        want = pool.stepwise(prefix, chain, slots)
        got = pool.forward([chain], [prefix], [slots], verify=[True])
        assert torch.equal(got, want), (length, (got - want).abs().max().item())


def test_chains_keep_their_bits_beside_other_rows(model: CausalLM) -> None:
    """One step: a plain decode on the chain's own prefix, one on another prompt, a second
    chain, and a prefill chunk (as long as the step stays within exact_rows); each chain's rows
    still equal its stepwise decode."""
    pool = Pool(model)
    chunk_len = min(20, exact_rows(model, pool.pool) - 12)
    shared = pool.prefill(ids(70, 3))
    other = pool.prefill(ids(45, 4))
    chain_a, slots_a = ids(6, 5), pool.slots(6)
    chain_b, slots_b = ids(4, 6), pool.slots(4)
    want_a = pool.stepwise(shared, chain_a, slots_a)
    want_b = pool.stepwise(other, chain_b, slots_b)
    chunk = ids(chunk_len, 7)
    got = pool.forward(
        [[9], chain_a, [11], chain_b, chunk],
        [shared, shared, other, other, EMPTY],
        [pool.slots(1), slots_a, pool.slots(1), slots_b, pool.slots(chunk_len)],
        verify=[False, True, False, True, False],
    )
    assert got.shape[0] == 1 + 6 + 1 + 4 + 1
    assert torch.equal(got[1:7], want_a)
    assert torch.equal(got[8:12], want_b)


def test_decode_rows_on_one_prompt_get_the_same_bits_batched_and_alone(model: CausalLM) -> None:
    """Twelve requests on one cached 200-token prompt (each with a few tokens of its own): one
    decode step of all of them equals each one's step alone."""
    pool = Pool(model)
    prompt = pool.prefill(ids(200, 8))
    seqs = []
    for i in range(12):
        own = pool.slots(3 + i % 4)
        pool.forward([ids(len(own), 20 + i)], [prompt], [own])
        seqs.append(np.concatenate([prompt, own]))
    tokens = [[t] for t in ids(12, 9)]
    alone = [pool.forward([t], [seq], [pool.slots(1)])[0] for t, seq in zip(tokens, seqs)]
    batched = pool.forward(tokens, seqs, [pool.slots(1) for _ in seqs])
    assert torch.equal(batched, torch.stack(alone))


def test_exact_rows_follows_the_matmul_routes(model_files, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Quantized blocks: any row count. Skinny float weights: up to 64 rows (16 on generic,
    where F.linear takes more). A float LM head skinny_linear cannot pack, or the PyTorch path:
    nothing is promised."""
    require_native_kernels()
    quant = load_causal_lm(str(model_files["quant"]))
    pool = KVPool(16, quant.config.num_layers, quant.config.num_kv_heads, quant.config.head_dim)
    assert exact_rows(quant, pool) == UNBOUNDED
    dense = load_causal_lm(str(model_files["float"]))
    expected = min(SKINNY_EXACT_ROWS, dense.backend.native_linear_rows)
    assert exact_rows(dense, pool) == expected
    dense.use_kernels(None)
    assert exact_rows(dense, pool) == 1


def test_an_lm_head_on_the_pytorch_route_promises_nothing(tmp_path: Path) -> None:
    require_native_kernels()
    save_tiny_model("llama-gqa-llama3rope", tmp_path, vocab_size=260)  # 260: not skinny
    model = load_causal_lm(str(tmp_path))
    c = model.config
    assert exact_rows(model, KVPool(16, c.num_layers, c.num_kv_heads, c.head_dim)) == 1


KERNEL_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                 (torch.bfloat16, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", KERNEL_DTYPES, ids=["f32", "f32-bf16kv", "bf16"])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (9, 3), (8, 2)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("threads", [1, 2])
def test_exact_units_give_each_row_its_lone_bits(
    isa: str,
    dtypes: tuple[torch.dtype, torch.dtype],
    heads: tuple[int, int],
    head_dim: int,
    threads: int,
) -> None:
    """The decode kernel directly: rows on a common prefix of many lengths (a chain's), laid out
    by exact_units (the run read once per unit), equal each row attended alone, on one thread
    or several (tasks go to threads in a dynamic schedule)."""
    kernels = require_native_kernels(isa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_exact_units(kernels, dtypes, heads, head_dim)
    finally:
        torch.set_num_threads(before)


def check_exact_units(
    kernels: native.Kernels,
    dtypes: tuple[torch.dtype, torch.dtype],
    heads: tuple[int, int],
    head_dim: int,
) -> None:
    q_dtype, kv_dtype = dtypes
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    k = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    for prefix_len in (1, 31, 32, 33, 95, 200, 517):
        order = torch.randperm(NUM_SLOTS, generator=gen)
        rows = 11
        lists = [order[: prefix_len + j + 1] for j in range(rows)]
        q = (torch.randn(rows, num_heads, head_dim, generator=gen) * 3).to(q_dtype)
        units = exact_units(list(range(rows)), prefix_len, num_heads // num_kv_heads)
        assert all(run % KEY_CHUNK == 0 for _, run in units)
        together = kernels.decode(q, k, v, native.DecodeLayout(lists, units))
        for j in range(rows):
            alone = kernels.decode(q[j : j + 1], k, v, native.DecodeLayout([lists[j]], []))
            assert torch.equal(alone[0], together[j]), (prefix_len, j)


def test_exact_units_share_a_run_only_in_row_by_row_units() -> None:
    units = exact_units(list(range(12)), 100, query_group=3)
    assert units == [([0, 1, 2, 3, 4], 96), ([5, 6, 7, 8, 9], 96), ([10, 11], 96)]
    assert exact_units(list(range(4)), 31, query_group=2) == []  # no whole chunk to share
    assert exact_units(list(range(4)), 300, query_group=8) == []  # one row per unit at most
