"""TieredRadixCache without a model: spilled pages load back bit-exact into tree-owned slots,
and a full L2 forgets chain ends first (never the chain being written)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2_pages import L2PageFile
from radixlm.cache.tiered_cache import PAGE_TOKENS, TieredRadixCache


def make_cache(tmp_path: Path, num_pages: int) -> TieredRadixCache:
    pool = KVPool(1024, num_layers=2, num_kv_heads=1, head_dim=4)
    payload = PAGE_TOKENS * pool.bytes_per_slot
    return TieredRadixCache(pool, L2PageFile(str(tmp_path / "l2"), num_pages, payload, b"t"))


def kv_of(tokens: np.ndarray, layer: int) -> torch.Tensor:
    """The KV a token gets in this test: its id (and the layer), on every channel."""
    return torch.from_numpy(tokens.astype(np.float32) + 0.5 * layer)[:, None, None].expand(-1, 1, 4)


def put(cache: TieredRadixCache, tokens: np.ndarray) -> None:
    """A finished request's KV enters the tree, then a match hits it (so it is admitted)."""
    slots = cache.alloc(len(tokens))
    for layer in range(2):
        cache.kv.k_cache(layer)[torch.from_numpy(slots)] = kv_of(tokens, layer)
        cache.kv.v_cache(layer)[torch.from_numpy(slots)] = -kv_of(tokens, layer)
    cache.tree.insert(tokens, slots)
    cache.num_in_flight -= len(tokens)
    cache.tree.match(tokens)


def loaded(cache: TieredRadixCache, tokens: np.ndarray) -> int:
    """Tokens `match` returns from an empty L1, checking their KV is the original."""
    m = cache.match(tokens)
    idx = torch.from_numpy(np.array(m.slots))  # a copy: match may return a read-only view
    for layer in range(2):
        assert torch.equal(cache.kv.k_cache(layer)[idx], kv_of(tokens[: m.length], layer))
        assert torch.equal(cache.kv.v_cache(layer)[idx], -kv_of(tokens[: m.length], layer))
    cache.check_integrity()
    return m.length


A = np.arange(3 * PAGE_TOKENS, dtype=np.int64)
B = np.arange(1000, 1000 + 3 * PAGE_TOKENS, dtype=np.int64)


def test_pages_load_back_bit_exact_and_an_older_chain_shrinks_from_its_end(
    tmp_path: Path,
) -> None:
    cache = make_cache(tmp_path, num_pages=4)
    put(cache, A)
    cache.flush()  # A's three pages go to L2
    put(cache, B)
    cache.flush()  # B needs three: one free, then A's end pages go, A's head stays
    cache.check_integrity()
    assert cache.tree.num_tokens == 0
    assert loaded(cache, A) == PAGE_TOKENS  # plain LRU over pages would have dropped A's head
    cache.flush()
    assert loaded(cache, B) == 3 * PAGE_TOKENS
    assert cache.l2_bad_pages == 0


def test_a_chain_never_evicts_its_own_head(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_pages=2)
    put(cache, A)
    cache.flush()  # three pages into two: the third is skipped, not written over the first
    assert cache.l2_written_pages == 2
    assert loaded(cache, A) == 2 * PAGE_TOKENS
