"""TieredRadixCache: RadixCache over a tree with a disk tier, and the loads that fill RAM from it.

Calls run one way: this cache drives its tree (cache/l2/tree.py), which writes extents through
its store (cache/l2/store.py), and its load registry (cache/l2/loads.py), which reads them
through the same store. A finished request's path is written through at once (`release`).
Extents are read back when a match continues into L2:

    tokens   |0 ........ 64 ........ 128 ........ 192 ...|
    extents  [ extent 0 ][ extent 1 ][ extent 2  ]          key_i = H(key_{i-1}, extent i)
    L1 match |=========== 100 ====|                          L2 continuation: extents 1, 2
    loaded                        |==== 100..192 ====|       -> new slots, then tree-owned

A match walks the tree once (`match_tiers`), allocates slots for the continuation, reads its
extents in parallel and copies their KV into the slots as each is verified; the loaded nodes join
L1. `match` waits for the reads; `match_or_load` leaves them running and the scheduler admits
the request when they are done. An extent that fails its key or checksum ends the load there and
is forgotten with everything below it; a read slower than `read_timeout_s` ends it too (the
extent stays): the rest is recomputed, never loaded wrong. A commit that would insert into a
chain being loaded ends that load first (those tokens were computed: nothing is loaded).

Accounting: slots as RadixCache (free + tree + in flight == capacity); extents: free extents +
extents held by nodes == num_extents (check_integrity checks both).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from radixlm.cache.integrity import IntegrityError
from radixlm.cache.kv_pool import KVPool, OutOfSlotsError
from radixlm.cache.l2.extent_file import ExtentFile, L2Error
from radixlm.cache.l2.loads import LOAD_BUCKETS, L2Load, LoadRegistry, LoadTicket, wait_any
from radixlm.cache.l2.node import EXTENT_TOKENS, l2_children
from radixlm.cache.l2.store import L2Store, fingerprint
from radixlm.cache.l2.tree import TieredTree, TierMatch
from radixlm.cache.prefix_cache import CommitResult, PendingMatch, RadixCache
from radixlm.cache.tree_node import DEFAULT_RETENTION, MatchResult, Namespace, TokenIds, TreeNode
from radixlm.config import CacheConfig

log = logging.getLogger(__name__)


class TieredRadixCache(RadixCache):
    """A RadixCache whose tree keeps evicted nodes on, and loads them back from, L2 extents."""

    def __init__(self, pool: KVPool, tree: TieredTree, store: L2Store, loads: LoadRegistry) -> None:
        if tree.store is not store or loads.store is not store:
            raise ValueError("the tree and the loads must use the cache's store")
        super().__init__(pool, tree)
        self.tree: TieredTree = tree
        self.kv = pool
        self.store = store
        self.loads = loads

    # -- a request's path: written through as it finishes ------------------------------------

    def commit(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        namespace: Namespace,
        node: TreeNode,
        retention: int = DEFAULT_RETENTION,
    ) -> CommitResult:
        """As RadixCache.commit; a load reading a chain that the insert reaches is ended first
        (another request computed those tokens: nothing of it is loaded)."""
        if self.loads.active:
            cached = len(tokens) // self.tree.page_size * self.tree.page_size
            for chain_node in self.tree.loads_in_way(tokens[:cached], namespace):
                load = self.loads.reading(chain_node)
                if load is not None:
                    self._abort(load)
        return super().commit(tokens, slots, namespace, node, retention)

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
            self._finish(self._reading(tm.busy))
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
            return LoadTicket(self._reading(tm.busy), ids, namespace, owner=False)
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

    def _start(self, ids: np.ndarray, namespace: Namespace, tm: TierMatch) -> L2Load | None:
        """Lock the prefix, pin the chain, allocate its slots and submit its reads; None if
        the slots cannot be had."""
        tree = self.tree
        tree.lock(tm.l1.node)  # held until the load ends: the prefix it extends stays
        tree.pin(tm.chain, True)
        try:
            slots = self.alloc(tm.end - tm.l1.length)
        except OutOfSlotsError:
            tree.unlock(tm.l1.node)
            tree.pin(tm.chain, False)
            return None
        return self.loads.start(ids, namespace, tm, slots)

    def _finish(self, load: L2Load) -> MatchResult:
        """Wait for the load's reads (until its deadline), then promote the extents that arrived
        in order; the first doubtful extent and everything below it are forgotten."""
        num_extents, bad = self.loads.collect(load)
        self._end(load)
        m = load.tm.l1
        arrived = (m.length // EXTENT_TOKENS + num_extents) * EXTENT_TOKENS
        end = max(m.length, min(load.tm.end, arrived))
        used = end - m.length
        self._free_in_flight(load.slots[used:])
        result = m
        if used:
            result = self.tree.promote(load.tm, end, load.slots[:used])
            self.num_in_flight -= used  # tree-owned now
        if bad:
            self._forget_after(result.node, load.ids, end)
        self.loads.observe(load, num_extents, used)
        return result

    def _abort(self, load: L2Load) -> None:
        """End a load before it finishes: nothing is promoted, its slots are freed."""
        self._end(load)
        self._free_in_flight(load.slots)
        self.loads.aborted += 1

    def _end(self, load: L2Load) -> None:
        """No late read copies anything, the chain is unpinned, the prefix unlocked. Its slots
        are the caller's to promote or free."""
        self.loads.end(load)
        self.tree.pin(load.tm.chain, False)
        self.tree.unlock(load.tm.l1.node)

    def _reading(self, node: TreeNode) -> L2Load:
        load = self.loads.reading(node)
        assert load is not None  # a pinned node is always a load's
        return load

    def _forget_after(self, node: TreeNode, ids: np.ndarray, end: int) -> None:
        """Forget the L2 node below `node` at `end` and everything under it: it holds an extent
        that failed its check, so nothing below it can be trusted or reached."""
        child = l2_children(node).get(ids[end : end + self.tree.page_size].tobytes())
        if child is not None:
            self.tree.drop_l2(child)

    # -- counters and checks ------------------------------------------------------------------

    def l2_stats(self) -> dict[str, Any]:
        """The L2 tier's counters (read in the engine thread; /v1/cache and /metrics)."""
        file, store, loads, tree = self.store.file, self.store, self.loads, self.tree
        return {
            "capacity_tokens": file.num_extents * EXTENT_TOKENS,
            "num_extents": file.num_extents,
            "num_free_extents": file.num_free,
            "num_tree_extents": tree.num_l2_extents,
            "num_l2_nodes": tree.num_l2_nodes,
            "hit_tokens": loads.hit_tokens,
            "written_bytes": file.written_bytes,
            "read_bytes": file.read_bytes,
            "written_extents": store.written_extents,
            "read_extents": loads.read_extents,
            "evicted_extents": tree.l2_evicted_extents,
            "through_extents": store.through_extents,
            "rejected_tokens": tree.l2_rejected_tokens,
            "bad_extents": loads.bad_extents,
            "read_timeouts": loads.read_timeouts,
            "loads": loads.num_loads,
            "load_seconds_sum": loads.seconds,
            "load_seconds_buckets": dict(zip([*map(str, LOAD_BUCKETS), "+Inf"],
                                             loads.buckets, strict=True)),
        }  # fmt: skip

    def check_integrity(self) -> None:
        """Both tiers' tree invariants, the slot account and the extent account."""
        super().check_integrity()
        held, free, total = (
            self.tree.num_l2_extents,
            self.store.file.num_free,
            self.store.file.num_extents,
        )
        if held + free != total:
            raise IntegrityError(
                f"L2 extent account: {free} free + {held} held by nodes != {total}"
            )

    def close(self) -> None:
        self.store.close()


def make_tiered_cache(
    pool: KVPool,
    file: ExtentFile,
    page_size: int = 1,
    policy: str = "lru",
    read_timeout_s: float = 1.0,
) -> TieredRadixCache:
    """A TieredRadixCache over `pool` whose extents live in `file`."""
    store = L2Store(file, pool)
    tree = TieredTree(store, page_size=page_size, policy=policy)
    return TieredRadixCache(pool, tree, store, LoadRegistry(store, read_timeout_s))


def open_tiered_cache(config: CacheConfig, pool: KVPool) -> TieredRadixCache | None:
    """A TieredRadixCache per `config` (l2_dir set), or None, logged, when the extent file
    cannot be created (the engine then runs without L2)."""
    assert config.l2_dir is not None
    path = os.path.join(config.l2_dir, "l2.extents")
    payload = EXTENT_TOKENS * pool.bytes_per_slot
    try:
        file = ExtentFile(path, config.l2_capacity // EXTENT_TOKENS, payload, fingerprint(pool))
    except L2Error as e:
        log.warning("running without L2: %s", e)
        return None
    return make_tiered_cache(pool, file, config.page_size, config.eviction)
