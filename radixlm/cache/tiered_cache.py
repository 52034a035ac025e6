"""RadixCache with an L2 tier of KV pages on disk, owned by the tree (cache/tiered_tree.py).

This class is the tree's page store: it decides what is worth writing (admission: a hit, a
conversation's second turn or later, or a first turn once enough of them measurably came back;
cache/turns.py) and hands pages to the page file's I/O threads (cache/l2_pages.py). A finished
request's path is written through at once: its pages are gathered on the I/O threads from slots
the tree still owns, and RAM evicting the node later only waits for a gather in progress (a
memory copy; one not started yet is copied then) before its slots are freed, never for the
disk. A node that leaves RAM unwritten is copied out on the engine thread, as its slots are
freed right after. Pages are read back when a match continues into L2:

    tokens   |0 ........ 64 ........ 128 ........ 192 ...|
    pages    [  page 0  ][  page 1  ][  page 2   ]           key_i = H(key_{i-1}, page i tokens)
    L1 match |=========== 100 ====|                          L2 continuation: pages 1, 2
    loaded                        |==== 100..192 ====|       -> new slots, then tree-owned

A match walks the tree once (`match_tiers`), allocates slots for the continuation, reads its
pages in parallel and copies their KV into the slots as each is verified; the loaded nodes join
L1. `match` waits for the reads; `match_or_load` leaves them running and the scheduler admits
the request when they are done (cache/l2_loads.py). A page that fails its key or checksum ends
the load there and is forgotten with everything below it; a read slower than `read_timeout_s`
ends it too (the page stays): the rest is recomputed, never loaded wrong.

Accounting: slots as RadixCache (free + tree + in flight == capacity); pages: free pages +
pages held by nodes == num_pages (check_integrity checks both).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from radixlm.cache.kv_pool import KVPool, OutOfSlotsError
from radixlm.cache.l2_loads import L2Load, LoadTicket, wait_any
from radixlm.cache.l2_pages import L2Error, L2PageFile, page_key
from radixlm.cache.page_copy import LoadSink, StagedPage, gather_page
from radixlm.cache.prefix_cache import PendingMatch, RadixCache
from radixlm.cache.radix_tree import MatchResult, Namespace, TreeNode
from radixlm.cache.tiered_tree import PAGE_TOKENS, TieredTree, TierMatch
from radixlm.cache.tree_node import DEFAULT_RETENTION, KEEP, TokenIds
from radixlm.cache.turns import TurnTracker
from radixlm.config import CacheConfig

log = logging.getLogger(__name__)

ADMIT_RATE = 0.25  # a first turn is written once this share of first turns came back
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


class TieredRadixCache(RadixCache):
    """A RadixCache whose tree keeps evicted nodes on, and loads them back from, L2 pages."""

    def __init__(
        self,
        pool: KVPool,
        l2: L2PageFile,
        page_size: int = 1,
        policy: str = "lru",
        read_timeout_s: float = 1.0,
    ) -> None:
        super().__init__(pool, page_size=page_size, policy=policy)
        self.tree: TieredTree = TieredTree(self, page_size=page_size, policy=policy)
        self.kv = pool
        self.l2 = l2
        self.read_timeout_s = read_timeout_s  # per page read; a slower one ends the load
        self._pending: dict[int, Future[None]] = {}  # page -> its last write
        self._staged: dict[int, StagedPage] = {}  # page -> its write through, until settled
        self._fingerprint = l2.fingerprint  # in every page key: another layout never matches
        self.l2_hit_tokens = self.l2_written_pages = self.l2_read_pages = 0
        self.l2_bad_pages = self.l2_read_timeouts = 0
        self.l2_loads = self.l2_aborted_loads = 0
        self.l2_through_pages = 0  # written when a request finished, not when RAM evicted
        self.l2_settled_pages = 0  # written through, but copied at eviction: not started yet
        self._loading: dict[int, L2Load] = {}  # id(chain node) -> the load reading it
        self.l2_load_seconds = 0.0
        self.l2_load_buckets = [0] * (len(LOAD_BUCKETS) + 1)  # the last one: above all bounds

    # -- the page store: admission, writes, frees -------------------------------------------

    def admits(self, node: TreeNode) -> bool:
        return _admits(node, self.tree.turns)

    @property
    def num_free_pages(self) -> int:
        return self.l2.num_free

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        pages = [p for p in (self.l2.alloc() for _ in range(count)) if p is not None]
        if not pages:
            return np.empty(0, dtype=np.int64)
        tokens, slots, namespace = self._path(node)
        keys = _chain(self._fingerprint, namespace, tokens, first + len(pages))
        for i, page in enumerate(pages):
            p = first + i
            page_slots = slots[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS]
            if staged:
                stage = self._staged[page] = StagedPage(self.kv, page_slots, keys[p])
                self._pending[page] = self.l2.write(page, keys[p], stage.gather)
            else:
                self._pending[page] = self.l2.write(page, keys[p], gather_page(self.kv, page_slots))
        self.l2_written_pages += len(pages)
        self.l2_through_pages += len(pages) if staged else 0
        if len(self._pending) > 4 * self.l2.num_pages // 3 + 64:
            self._pending = {p: f for p, f in self._pending.items() if not f.done()}
            self._staged = {p: s for p, s in self._staged.items() if p in self._pending}
        return np.array(pages, dtype=np.int64)

    def settle(self, node: TreeNode) -> None:
        assert node.pages is not None
        for page in node.pages.tolist():
            stage = self._staged.pop(page, None)
            if stage is not None and not stage.settle():  # its write has not started: copy now
                payload = gather_page(self.kv, stage.slots)
                self._pending[page] = self.l2.write(page, stage.key, payload)
                self.l2_settled_pages += 1

    def free_pages(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            stage = self._staged.pop(page, None)
            pending = self._pending.pop(page, None)
            # A page is reused only once its last write is done; a staged one that was not
            # copied yet never writes (no wait behind a slow disk for it).
            if pending is not None and (stage is None or stage.settle()):
                _wait(pending)
            self.l2.free(page)

    def release(self, node: TreeNode, in_flight_slots: np.ndarray, finished: bool = True) -> None:
        """As RadixCache.release; a finished request's path is first written through to L2
        when it is worth keeping (`TieredTree.write_through`), so RAM evicting it later frees
        its slots and writes nothing."""
        if finished:
            self.tree.write_through(node)
        super().release(node, in_flight_slots, finished)

    # -- matching continues into L2 ----------------------------------------------------------

    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        """The L1 prefix, lengthened by what L2 holds after it, loaded now (waiting for the
        reads). Unlike RadixCache.match this may allocate slots and hand them to the tree."""
        ids = np.asarray(tokens, dtype=np.int64)
        tm = self.tree.match_tiers(ids, namespace)
        if tm.busy is not None:  # another request's load is reading it: let it finish
            self._finish(self._loading[id(tm.busy)])
            return self.match(ids, namespace)
        load = self._start(ids, namespace, tm) if tm.chain else None
        return tm.l1 if load is None else self._finish(load)

    def peek(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        """The length `match` would return: the RAM prefix and what it would load from L2."""
        return self.tree.peek_tiers(tokens, namespace)

    def match_or_load(
        self, tokens: TokenIds, namespace: Namespace = None
    ) -> MatchResult | PendingMatch:
        ids = np.asarray(tokens, dtype=np.int64)
        tm = self.tree.match_tiers(ids, namespace)
        if tm.busy is not None:
            return LoadTicket(self._loading[id(tm.busy)], ids, namespace, owner=False)
        load = self._start(ids, namespace, tm) if tm.chain else None
        return tm.l1 if load is None else LoadTicket(load, ids, namespace, owner=True)

    def finish_load(self, pending: PendingMatch) -> MatchResult:
        if not isinstance(pending, LoadTicket):
            raise TypeError(f"not a load of this cache: {pending!r}")
        if pending.load.done:
            return self.match(pending.ids, pending.namespace)
        result = self._finish(pending.load)
        return result if pending.owner else self.match(pending.ids, pending.namespace)

    def wait_loads(self, pending: list[PendingMatch], timeout_s: float) -> None:
        wait_any([p for p in pending if isinstance(p, LoadTicket)], timeout_s)

    def abort_load(self, node: TreeNode) -> None:
        load = self._loading[id(node)]
        self._release(load)
        self._free_in_flight(load.slots)
        self.l2_aborted_loads += 1

    def _start(self, ids: np.ndarray, namespace: Namespace, tm: TierMatch) -> L2Load | None:
        """Lock the prefix, pin the chain, allocate its slots and submit its reads; None if
        the slots cannot be had."""
        m, tree = tm.l1, self.tree
        tree.lock(m.node)  # held until the load ends: the prefix it extends stays
        tree.pin(tm.chain, True)
        try:
            slots = self.alloc(tm.end - m.length)
        except OutOfSlotsError:
            tree.unlock(m.node)
            tree.pin(tm.chain, False)
            return None
        pages = np.concatenate([c.pages for c in tm.chain if c.pages is not None]).tolist()
        start, first = m.length, m.length // PAGE_TOKENS
        keys = _chain(self._fingerprint, namespace, ids[: tm.end], first + len(pages))
        sink = LoadSink(self.kv)
        futures: list[Future[bytearray | None] | None] = []
        for i, page in enumerate(pages):
            t0 = (first + i) * PAGE_TOKENS  # the page's first token; the slots start at `start`
            copy = sink.page(slots[max(t0, start) - start : t0 + PAGE_TOKENS - start],
                             max(0, start - t0))  # fmt: skip
            ok = self._written(page)
            futures.append(self.l2.read(page, keys[first + i], copy) if ok else None)
        now = time.perf_counter()
        load = L2Load(tm, ids, slots, futures, sink, now, now + self.read_timeout_s * len(pages))
        for node in tm.chain:
            self._loading[id(node)] = load
        return load

    def _finish(self, load: L2Load) -> MatchResult:
        """Wait for the load's reads (until its deadline), then promote the pages that arrived
        in order; the first doubtful page and everything below it are forgotten."""
        num_pages, bad = self._collect(load)
        self._release(load)
        m = load.tm.l1
        end = max(m.length, min(load.tm.end, (m.length // PAGE_TOKENS + num_pages) * PAGE_TOKENS))
        used = end - m.length
        self._free_in_flight(load.slots[used:])
        result = m
        if used:
            result = self.tree.promote(load.tm, end, load.slots[:used])
            self.num_in_flight -= used  # tree-owned now
        if bad:
            self._forget_after(result.node, load.ids, end)
        self._observe_load(time.perf_counter() - load.started, num_pages, used)
        return result

    def _collect(self, load: L2Load) -> tuple[int, bool]:
        """How many leading pages arrived, and whether the next one was doubtful (a miss)
        rather than late (it stays on L2)."""
        done, bad = 0, False
        for future in load.futures:
            try:
                wait_s = max(0.0, load.deadline - time.perf_counter())
                data = None if future is None else future.result(wait_s)
            except FutureTimeout:
                self.l2_read_timeouts += 1
                log.warning("L2 read slower than %.3f s a page: recomputing", self.read_timeout_s)
                break
            if data is None:
                self.l2_bad_pages += 1
                bad = True
                break
            done += 1
        return done, bad

    def _release(self, load: L2Load) -> None:
        """End a load: no late read copies anything, the chain is unpinned, the prefix
        unlocked. Its slots are the caller's to promote or free."""
        load.sink.cancel()
        for future in load.futures:
            if future is not None:
                future.cancel()  # not started: no I/O for pages nobody will use
        for node in load.tm.chain:
            self._loading.pop(id(node), None)
        self.tree.pin(load.tm.chain, False)
        self.tree.unlock(load.tm.l1.node)
        load.done = True

    def _written(self, page: int) -> bool:
        """Whether `page`'s last write is done and succeeded (a failed one is a miss)."""
        pending = self._pending.pop(page, None)
        return pending is None or _wait(pending)

    def _forget_after(self, node: TreeNode, ids: np.ndarray, end: int) -> None:
        """Forget the L2 node below `node` at `end` and everything under it: it holds a page
        that failed its check, so nothing below it can be trusted or reached."""
        child = node.l2_children.get(ids[end : end + self.tree.page_size].tobytes())
        if child is not None:
            self.tree.drop_l2(child)

    def _observe_load(self, seconds: float, num_pages: int, hit_tokens: int) -> None:
        self.l2_loads += 1
        self.l2_load_seconds += seconds
        bucket = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
        self.l2_load_buckets[bucket] += 1
        self.l2_read_pages += num_pages
        self.l2_hit_tokens += hit_tokens

    def l2_stats(self) -> dict[str, Any]:
        """The L2 tier's counters (read in the engine thread; /v1/cache and /metrics)."""
        return {
            "capacity_tokens": self.l2.num_pages * PAGE_TOKENS,
            "num_pages": self.l2.num_pages,
            "num_free_pages": self.l2.num_free,
            "num_tree_pages": self.tree.num_l2_pages,
            "num_l2_nodes": self.tree.num_l2_nodes,
            "hit_tokens": self.l2_hit_tokens,
            "written_bytes": self.l2.written_bytes,
            "read_bytes": self.l2.read_bytes,
            "written_pages": self.l2_written_pages,
            "read_pages": self.l2_read_pages,
            "evicted_pages": self.tree.l2_evicted_pages,
            "through_pages": self.l2_through_pages,
            "rejected_tokens": self.l2_rejected_tokens,
            "bad_pages": self.l2_bad_pages,
            "read_timeouts": self.l2_read_timeouts,
            "loads": self.l2_loads,
            "load_seconds_sum": self.l2_load_seconds,
            "load_seconds_buckets": dict(zip([*map(str, LOAD_BUCKETS), "+Inf"],
                                             self.l2_load_buckets, strict=True)),
        }  # fmt: skip

    @property
    def l2_rejected_tokens(self) -> int:
        return self.tree.l2_rejected_tokens

    def _path(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray, Namespace]:
        keys: list[bytes] = []
        top = node
        while top.parent is not None:
            keys.append(top.key)
            top = top.parent
        tokens = np.frombuffer(b"".join(reversed(keys)), dtype=np.int64)
        return tokens, self.tree.path_slots(node), top.namespace

    def check_integrity(self) -> None:
        """Both tiers' tree invariants, the slot account and the page account."""
        super().check_integrity()
        from radixlm.cache.integrity import IntegrityError

        held, free = self.tree.num_l2_pages, self.l2.num_free
        if held + free != self.l2.num_pages:
            raise IntegrityError(
                f"L2 page account: {free} free + {held} held by nodes != {self.l2.num_pages}"
            )

    def close(self) -> None:
        self.l2.close()


def open_tiered_cache(config: CacheConfig, pool: object) -> TieredRadixCache | None:
    """A TieredRadixCache per `config` (l2_dir set), or None, logged, when the page file cannot
    be created (the engine then runs without L2)."""
    assert config.l2_dir is not None
    if not isinstance(pool, KVPool):
        raise ValueError("an L2 tier needs the KV pool itself, not a bare slot allocator")
    path = os.path.join(config.l2_dir, "l2.pages")
    payload = PAGE_TOKENS * pool.bytes_per_slot
    try:
        l2 = L2PageFile(path, config.l2_capacity // PAGE_TOKENS, payload, _fingerprint(pool))
    except L2Error as e:
        log.warning("running without L2: %s", e)
        return None
    return TieredRadixCache(pool, l2, config.page_size, config.eviction)


def _admits(node: TreeNode, turns: TurnTracker) -> bool:
    if node.retention != DEFAULT_RETENTION:  # the client said (RAM_ONLY or KEEP)
        return node.retention == KEEP
    if node.turn >= 2 or node.hits > 0:
        return True
    rate = turns.return_rate(node.turn)
    return rate is not None and rate >= ADMIT_RATE


def _chain(fingerprint: bytes, namespace: Namespace, tokens: np.ndarray, n: int) -> list[bytes]:
    """The chained keys of the first `n` pages of `tokens` (the last one partial when `tokens`
    ends inside it: a tail page)."""
    keys: list[bytes] = []
    prev = None
    for p in range(n):
        prev = page_key(
            fingerprint, namespace, tokens[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS], prev
        )
        keys.append(prev)
    return keys


def _wait(pending: Future[None]) -> bool:
    """Whether a page write completed; a failed one (disk full) is logged and is a miss."""
    try:
        pending.result()
        return True
    except OSError as e:
        log.warning("L2 page write failed (%s); the page is a miss", e)
        return False


def _fingerprint(pool: KVPool) -> bytes:
    """The KV layout pages are only valid for (the file is reinitialised at every start)."""
    return f"{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}/{pool.dtype}".encode()
