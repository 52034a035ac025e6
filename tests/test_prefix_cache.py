"""The prefix cache as the engine drives it: match -> lock -> alloc -> commit -> release, with
the slot account (free + tree-owned + in flight == capacity) checked after every call."""

from __future__ import annotations

import numpy as np
import pytest

from radixlm.cache import create_prefix_cache
from radixlm.cache.integrity import IntegrityError
from radixlm.cache.kv_pool import KVPool, OutOfSlotsError, SlotAllocator
from radixlm.cache.no_cache import NoCache
from radixlm.cache.prefix_cache import PrefixCache, RadixCache
from radixlm.cache.radix_tree import RadixTree
from radixlm.config import CacheConfig


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def run_request(
    cache: PrefixCache, tokens: np.ndarray, namespace: str | None = None
) -> tuple[int, np.ndarray]:
    """One whole request: reuse, compute the rest, commit, finish. Returns (reused, slots)."""
    m = cache.match(tokens[:-1], namespace)
    cache.lock(m.node)
    slots = np.concatenate([m.slots, cache.alloc(len(tokens) - m.length)])
    cache.check_integrity()
    c = cache.commit(tokens, slots, namespace, m.node)
    cache.check_integrity()
    cache.release(c.node, c.slots[c.cached_len :])
    cache.check_integrity()
    return m.length, c.slots


def test_a_second_request_reuses_the_first_ones_prefix() -> None:
    cache = RadixCache(SlotAllocator(64))
    reused, first = run_request(cache, ids(1, 2, 3, 4, 5))
    assert reused == 0 and cache.num_tree_tokens == 5 and cache.num_in_flight == 0
    reused, second = run_request(cache, ids(1, 2, 3, 9))
    assert reused == 3 and np.array_equal(second[:3], first[:3])
    assert cache.num_tree_tokens == 6 and cache.num_free == 58


def test_concurrent_duplicates_are_freed_and_the_tree_slots_are_used() -> None:
    cache = RadixCache(SlotAllocator(64))
    tokens = ids(1, 2, 3, 4, 5, 6)
    runs = []
    for _ in range(2):  # both match nothing, then both compute the same prefix
        m = cache.match(tokens, None)
        cache.lock(m.node)
        runs.append((m.node, cache.alloc(len(tokens))))
    a = cache.commit(tokens, runs[0][1], None, runs[0][0])
    b = cache.commit(tokens, runs[1][1], None, runs[1][0])
    cache.check_integrity()
    assert np.array_equal(a.slots, runs[0][1]) and np.array_equal(b.slots, a.slots)
    assert cache.num_in_flight == 0 and cache.num_free == 64 - 6  # b's copies went back
    assert b.node is a.node and a.node.lock_ref == 2
    for c in (a, b):
        cache.release(c.node, c.slots[c.cached_len :])
    cache.check_integrity()
    assert cache.num_evictable == 6


def test_duplicate_prefix_with_a_longer_own_tail() -> None:
    cache = RadixCache(SlotAllocator(64))
    run_request(cache, ids(1, 2, 3, 4))
    root = cache.match(ids(9), None).node  # a request that matched nothing before the insert
    cache.lock(root)
    mine = cache.alloc(6)
    c = cache.commit(ids(1, 2, 3, 4, 7, 8), mine, None, root)
    cache.check_integrity()
    assert c.slots[:4].tolist() == cache.match(ids(1, 2, 3, 4)).slots.tolist()
    assert c.slots[4:].tolist() == mine[4:].tolist() and c.cached_len == 6
    cache.release(c.node, c.slots[c.cached_len :])
    cache.check_integrity()


def test_page_size_4_keeps_the_partial_page_in_flight() -> None:
    cache = RadixCache(SlotAllocator(64), RadixTree(page_size=4))
    m = cache.match(ids(*range(9)), None)
    cache.lock(m.node)
    slots = cache.alloc(10)
    c = cache.commit(ids(*range(10)), slots, None, m.node)
    assert c.cached_len == 8 and cache.num_tree_tokens == 8 and cache.num_in_flight == 2
    cache.check_integrity()
    grown = np.concatenate([c.slots, cache.alloc(3)])  # decode three more tokens
    c2 = cache.commit(ids(*range(13)), grown, None, c.node)
    assert c2.cached_len == 12 and cache.num_in_flight == 1
    cache.release(c2.node, c2.slots[c2.cached_len :])
    cache.check_integrity()
    assert cache.num_in_flight == 0 and cache.match(ids(*range(13))).length == 12


def test_abort_before_any_commit_frees_everything_in_flight() -> None:
    cache = RadixCache(SlotAllocator(32))
    run_request(cache, ids(1, 2, 3))
    m = cache.match(ids(1, 2, 3, 4, 5), None)
    cache.lock(m.node)
    new = cache.alloc(2)
    cache.release(m.node, new)  # aborted: nothing computed is kept
    cache.check_integrity()
    assert cache.num_in_flight == 0 and cache.num_tree_tokens == 3 and m.node.lock_ref == 0


def test_alloc_evicts_unlocked_leaves_lru_first() -> None:
    cache = RadixCache(SlotAllocator(10))
    run_request(cache, ids(1, 2, 3, 4))
    run_request(cache, ids(5, 6, 7, 8))
    cache.match(ids(1, 2, 3, 4))  # touch the first: the second is now the oldest
    new = cache.alloc(5)
    cache.check_integrity()
    assert len(new) == 5 and cache.match(ids(5, 6, 7, 8)).length == 0
    assert cache.match(ids(1, 2, 3, 4)).length == 4


def test_alloc_that_cannot_be_satisfied_changes_nothing() -> None:
    cache = RadixCache(SlotAllocator(10))
    run_request(cache, ids(1, 2, 3, 4))
    m = cache.match(ids(5, 6), None)
    cache.lock(m.node)
    held = cache.alloc(3)
    locked = cache.match(ids(1, 2), None)
    cache.lock(locked.node)  # 2 of the 4 cached tokens are protected now
    before = cache.stats()
    with pytest.raises(OutOfSlotsError):
        cache.alloc(6)  # 3 free + 2 evictable < 6
    assert cache.stats() == before
    cache.check_integrity()
    cache.unlock(locked.node)
    cache.release(m.node, held)
    cache.check_integrity()


def test_flush_drops_every_unlocked_node_and_keeps_locked_ones() -> None:
    cache = RadixCache(SlotAllocator(32))
    run_request(cache, ids(1, 2, 3))
    run_request(cache, ids(4, 5, 6, 7))
    m = cache.match(ids(1, 2, 3), None)
    cache.lock(m.node)
    assert cache.flush() == 4
    assert cache.num_tree_tokens == 3 and cache.num_free == 29
    cache.check_integrity()


def test_retraction_commits_then_releases() -> None:
    cache = RadixCache(SlotAllocator(32))
    m = cache.match(ids(1, 2, 3, 4), None)
    cache.lock(m.node)
    slots = cache.alloc(2)  # the first prefill chunk computed two tokens
    c = cache.commit(ids(1, 2), slots, None, m.node)
    cache.release(c.node, c.slots[c.cached_len :])  # retracted: the chunk stays cached
    cache.check_integrity()
    assert cache.match(ids(1, 2, 3, 4)).length == 2 and cache.num_in_flight == 0


def test_commit_rejects_a_node_that_is_not_on_the_path() -> None:
    cache = RadixCache(SlotAllocator(32))
    run_request(cache, ids(1, 2, 3))
    m = cache.match(ids(1, 2, 3), None)
    cache.lock(m.node)
    with pytest.raises(ValueError, match="does not end"):
        cache.commit(ids(7, 8, 9, 1), np.arange(4), None, m.node)
    with pytest.raises(ValueError, match="does not end"):
        cache.commit(ids(1, 2, 3, 4), np.arange(4), "other", m.node)
    cache.check_integrity()


def test_namespaces_do_not_share_through_the_cache() -> None:
    cache = RadixCache(SlotAllocator(32))
    run_request(cache, ids(1, 2, 3, 4), "a")
    assert run_request(cache, ids(1, 2, 3, 4), "b")[0] == 0
    assert run_request(cache, ids(1, 2, 3, 4), "a")[0] == 3


def test_accounting_check_catches_a_lost_slot() -> None:
    cache = RadixCache(SlotAllocator(8))
    cache.pool.alloc(1)  # taken behind the cache's back
    with pytest.raises(IntegrityError, match="accounting"):
        cache.check_accounting()


def test_no_cache_never_reuses_and_frees_on_release() -> None:
    cache = create_prefix_cache(CacheConfig(num_slots=16, cache="none"), SlotAllocator(16))
    assert isinstance(cache, NoCache)
    assert run_request(cache, ids(1, 2, 3))[0] == 0
    assert run_request(cache, ids(1, 2, 3))[0] == 0
    assert cache.num_free == 16 and cache.stats().num_queries == 2
    assert isinstance(create_prefix_cache(CacheConfig(), SlotAllocator(4)), RadixCache)


def test_random_request_streams_keep_the_account(seed: int = 0) -> None:
    """Requests with shared prefixes, chunked prefills, aborts and pressure, interleaved."""
    rng = np.random.default_rng(seed)
    pool = KVPool(num_slots=96, num_layers=1, num_kv_heads=1, head_dim=2)
    for page_size in (1, 4):
        cache = RadixCache(pool, RadixTree(page_size=page_size))
        running: list[dict] = []
        for _ in range(1500):
            if running and (len(running) >= 4 or rng.random() < 0.5):
                _advance(cache, running.pop(int(rng.integers(len(running)))), rng, running)
            else:
                prompt = rng.integers(0, 3, size=int(rng.integers(1, 24)))
                m = cache.match(prompt[:-1], None)
                cache.lock(m.node)
                running.append({"tokens": prompt, "slots": m.slots, "node": m.node})
            cache.check_integrity()
        for req in running:
            cache.release(req["node"], req["slots"][req["node"].depth :])
        cache.check_integrity()
        assert cache.num_in_flight == 0 and cache.num_protected == 0
        cache.flush()


def _advance(cache: RadixCache, req: dict, rng: np.random.Generator, running: list) -> None:
    """Compute a chunk of the request (or abort it), commit, and maybe finish."""
    todo = len(req["tokens"]) - len(req["slots"])
    n = int(rng.integers(1, todo + 1)) if todo > 0 else 1
    try:
        new = cache.alloc(n)
    except OutOfSlotsError:
        cache.release(req["node"], req["slots"][req["node"].depth :])  # give up under pressure
        return
    slots = np.concatenate([req["slots"], new])
    tokens = req["tokens"][: len(slots)]
    if len(tokens) < len(slots):  # decoding: the output token is new
        tokens = np.concatenate([req["tokens"], rng.integers(0, 3, size=1)])
        req["tokens"] = tokens
    c = cache.commit(tokens, slots, None, req["node"])
    req.update(slots=c.slots, node=c.node)
    if rng.random() < 0.3:
        cache.release(c.node, c.slots[c.cached_len :])
    else:
        running.append(req)
