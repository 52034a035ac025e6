"""TieredRadixCache without a model: spilled extents load back bit-exact into tree-owned slots,
and a full L2 forgets chain ends first (never the chain being written)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2.cache import TieredRadixCache, make_tiered_cache
from radixlm.cache.l2.extent_file import HEADER_BYTES, ExtentFile, Faults
from radixlm.cache.l2.loads import LoadTicket
from radixlm.cache.l2.node import EXTENT_TOKENS, extents_of, l2_children
from radixlm.cache.l2.store import fingerprint as layout_fingerprint
from radixlm.cache.prefix_cache import PendingMatch


def make_cache(
    tmp_path: Path,
    num_extents: int,
    dtype: torch.dtype = torch.float32,
    fingerprint: bytes | None = None,
) -> TieredRadixCache:
    tmp_path.mkdir(parents=True, exist_ok=True)
    pool = KVPool(1024, num_layers=2, num_kv_heads=1, head_dim=4, dtype=dtype)
    payload = EXTENT_TOKENS * pool.bytes_per_slot
    fingerprint = fingerprint or layout_fingerprint(pool)
    return make_tiered_cache(
        pool, ExtentFile(str(tmp_path / "l2"), num_extents, payload, fingerprint)
    )


def kv_of(tokens: np.ndarray, layer: int) -> torch.Tensor:
    """The KV a token gets in this test: its id (and the layer), on every channel."""
    return torch.from_numpy(tokens.astype(np.float32) + 0.5 * layer)[:, None, None].expand(-1, 1, 4)


def put(cache: TieredRadixCache, tokens: np.ndarray) -> None:
    """A request's computed KV enters the tree (committed, then released unfinished, so
    nothing is written through), then a match hits it (so it is worth writing)."""
    slots = cache.alloc(len(tokens))
    for layer in range(2):
        cache.kv.k_cache(layer)[torch.from_numpy(slots)] = kv_of(tokens, layer).to(cache.kv.dtype)
        cache.kv.v_cache(layer)[torch.from_numpy(slots)] = -kv_of(tokens, layer).to(cache.kv.dtype)
    done = cache.commit(tokens, slots, None, cache.tree.root())
    cache.release(done.node, done.slots[done.cached_len :], finished=False)
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


A = np.arange(3 * EXTENT_TOKENS, dtype=np.int64)
B = np.arange(1000, 1000 + 3 * EXTENT_TOKENS, dtype=np.int64)


def test_extents_load_back_bit_exact_and_an_older_chain_shrinks_from_its_end(
    tmp_path: Path,
) -> None:
    cache = make_cache(tmp_path, num_extents=4)
    put(cache, A)
    cache.flush()  # A's three extents go to L2
    put(cache, B)
    cache.flush()  # B needs three: one free, then A's end extents go, A's head stays
    cache.check_integrity()
    assert cache.tree.num_tokens == 0
    assert loaded(cache, A) == EXTENT_TOKENS  # plain LRU over extents would have dropped A's head
    cache.flush()
    assert loaded(cache, B) == 3 * EXTENT_TOKENS
    assert cache.loads.bad_extents == 0


def test_a_chain_never_evicts_its_own_head(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_extents=2)
    put(cache, A)
    cache.flush()  # three extents into two: the third is skipped, not written over the first
    assert cache.store.written_extents == 2
    assert loaded(cache, A) == 2 * EXTENT_TOKENS


def test_a_slow_read_is_recomputed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache(tmp_path, num_extents=4)
    put(cache, A)
    cache.flush()
    cache.loads.read_timeout_s = 0.05
    disk_recovered = threading.Event()

    def slow(extent: int) -> None:
        disk_recovered.wait(5.0)

    cache.store.file.faults = Faults(read=slow)
    with caplog.at_level(logging.WARNING):
        assert loaded(cache, A) == 0  # nothing waited for, nothing wrong: all recomputed
    assert cache.loads.read_timeouts == 1 and cache.loads.bad_extents == 0
    assert "L2 read slower than" in caplog.text
    cache.store.file.faults = Faults()
    disk_recovered.set()  # the reads still queued finish
    assert loaded(cache, A) == 3 * EXTENT_TOKENS  # the extents were not doubtful: kept


@pytest.mark.parametrize(
    ("dtype", "fingerprint"),
    [(torch.bfloat16, None), (torch.int8, None), (torch.float32, b"another model")],
)
def test_a_extent_file_from_another_model_or_dtype_is_a_miss(
    tmp_path: Path, dtype: torch.dtype, fingerprint: bytes | None
) -> None:
    ours = make_cache(tmp_path / "ours", num_extents=4)
    theirs = make_cache(tmp_path / "theirs", num_extents=4, dtype=dtype, fingerprint=fingerprint)
    for cache in (ours, theirs):
        put(cache, A)
        cache.flush()
        cache.store.wait_writes()
    with open(tmp_path / "ours" / "l2", "r+b") as f:  # their extents where ours were
        f.write((tmp_path / "theirs" / "l2").read_bytes())
    assert loaded(ours, A) == 0 and ours.loads.bad_extents == 1
    assert ours.tree.num_l2_extents == 0  # the doubtful chain is forgotten


def test_a_background_load_keeps_every_account_while_it_runs(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_extents=4)
    put(cache, A)
    cache.flush()
    ticket = cache.match_or_load(A)
    assert isinstance(ticket, PendingMatch)
    cache.check_integrity()  # slots in flight, the chain pinned
    assert cache.num_in_flight == 3 * EXTENT_TOKENS
    joined = cache.match_or_load(A)  # another request for the same chain waits on the same read
    assert isinstance(joined, LoadTicket) and isinstance(ticket, LoadTicket)
    assert joined.load is ticket.load
    cache.wait_loads([ticket], timeout_s=5.0)
    while not ticket.ready():
        cache.wait_loads([ticket], timeout_s=5.0)
    assert cache.finish_load(ticket).length == 3 * EXTENT_TOKENS
    assert cache.finish_load(joined).length == 3 * EXTENT_TOKENS
    assert cache.num_in_flight == 0
    assert loaded(cache, A) == 3 * EXTENT_TOKENS  # bit-exact, tree-owned


def test_a_load_that_an_insert_overtakes_is_aborted(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_extents=4)
    put(cache, A)
    cache.flush()
    ticket = cache.match_or_load(A)
    assert isinstance(ticket, PendingMatch)
    put(cache, A)  # another request computed A meanwhile: it claims the chain
    assert cache.loads.aborted == 1 and cache.num_in_flight == 0
    cache.check_integrity()
    assert ticket.ready() and cache.finish_load(ticket).length == len(A)
    assert loaded(cache, A) == len(A)


def test_a_staged_extent_dropped_before_its_copy_never_waits_for_the_disk(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, num_extents=4)
    put(cache, A)
    disk = threading.Event()

    def stuck(extent: int) -> None:
        disk.wait(10.0)  # the disk hangs before any staged extent is gathered

    cache.store.file.faults = Faults(write=stuck)
    m = cache.tree.match(A)
    cache.lock(m.node)
    assert cache.tree.write_through(m.node) == 3 and cache.store.file.num_free == 1
    cache.unlock(m.node)
    t0 = time.perf_counter()
    assert cache.tree.flush_l2() == 3  # RAM keeps A: L2 drops its copy, uncopied extents free
    assert time.perf_counter() - t0 < 5.0 and cache.store.file.num_free == 4
    cache.check_integrity()
    disk.set()
    cache.flush()  # A leaves RAM unwritten (its copy was dropped): written now, and loads
    cache.store.file.faults = Faults()
    assert loaded(cache, A) == 3 * EXTENT_TOKENS and cache.loads.bad_extents == 0


def test_a_conversation_tail_loads_back_bit_exact_and_a_bad_one_is_recomputed(
    tmp_path: Path,
) -> None:
    turn = np.arange(2 * EXTENT_TOKENS + 20, dtype=np.int64)  # ends inside extent 2
    follow_up = np.concatenate([turn, np.arange(5000, 5030, dtype=np.int64)])
    for bad in (False, True):
        cache = make_cache(tmp_path / str(bad), num_extents=4)
        put(cache, turn)
        cache.flush()  # extents 0, 1 and the tail extent: tokens 128..148
        assert cache.tree.num_l2_extents == 3
        [node] = l2_children(cache.tree.root()).values()
        extents = extents_of(node)
        assert extents is not None
        tail = extents[-1]
        cache.store.wait_writes()
        if bad:  # one flipped byte in the tail extent's payload
            with open(tmp_path / str(bad) / "l2", "r+b") as f:
                f.seek(int(tail) * cache.store.file.extent_bytes + HEADER_BYTES + 5)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 1]))
        assert loaded(cache, follow_up) == (2 * EXTENT_TOKENS if bad else len(turn))
        assert cache.loads.bad_extents == bad
        slot = cache.kv.bytes_per_slot  # the tail extent moved its 20 tokens' bytes, no more
        assert cache.l2_stats()["written_bytes"] == len(turn) * slot
        assert cache.l2_stats()["read_bytes"] == len(turn) * slot


def test_an_int8_pool_s_extents_carry_codes_and_scales_back_bit_exact(tmp_path: Path) -> None:
    """An int8 pool's extent holds its rows' codes and their bfloat16 scales (bytes_per_slot
    each token: codes + 2 bytes per row), and a load writes both back byte for byte, the tail
    extent of a turn included."""
    cache = make_cache(tmp_path, num_extents=4, dtype=torch.int8)
    pool = cache.kv
    assert pool.bytes_per_slot == 2 * 2 * 1 * (4 + 2)
    turn = np.arange(2 * EXTENT_TOKENS + 20, dtype=np.int64)  # ends inside extent 2
    slots = cache.alloc(len(turn))
    idx, gen = torch.from_numpy(slots), torch.Generator().manual_seed(0)
    written = []
    for layer in range(2):
        kv = pool.layer(layer)
        assert kv.scales is not None
        for t in (kv.k, kv.v, *kv.scales):
            t[idx] = torch.randint(-127, 128, t[idx].shape, generator=gen).to(t.dtype) * (
                1 if t.dtype == torch.int8 else 0.01
            )
            written.append(t[idx].clone())
    done = cache.commit(turn, slots, None, cache.tree.root())
    cache.release(done.node, done.slots[done.cached_len :], finished=False)
    cache.tree.match(turn)
    cache.flush()
    assert cache.tree.num_tokens == 0 and cache.tree.num_l2_extents == 3
    cache.store.wait_writes()
    m = cache.match(turn)
    assert m.length == len(turn) and cache.loads.bad_extents == 0
    back = torch.from_numpy(np.array(m.slots))
    got = []
    for layer in range(2):
        kv = pool.layer(layer)
        assert kv.scales is not None
        got += [t[back] for t in (kv.k, kv.v, *kv.scales)]
    assert all(torch.equal(a, b) for a, b in zip(written, got))
    assert cache.l2_stats()["written_bytes"] == len(turn) * pool.bytes_per_slot
    cache.check_integrity()
