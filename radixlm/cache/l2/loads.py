"""Loads from L2 that overlap compute: the registry of chains being read, and its counters.

A request whose match continues into L2 does not wait for the disk on the engine thread:

    start   the cache locks the RAM prefix, pins the chain and allocates its slots (in
            flight); the registry submits the reads, each verified extent copied into its slots
    ready   every read finished, or the deadline passed (`read_timeout_s` an extent)
    finish  the registry counts the extents that arrived in order up to the first missing or
            late one and ends the load; the cache unpins, unlocks, promotes what arrived
            (tree-owned), frees the other slots and forgets a doubtful subtree
    abort   an insert is about to reach the chain (another request computed those tokens):
            the cache ends the load first and promotes nothing

Meanwhile the scheduler keeps the request waiting and other requests keep computing. Each
request holds a `LoadTicket`; requests whose match runs into a chain being loaded wait on the
same load (a chain is read once) and match again when it is done. The registry reads through
the store (cache/l2/store.py) and never touches the tree or the slot account.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from radixlm.cache.l2.extent_copy import LoadSink
from radixlm.cache.l2.node import EXTENT_TOKENS
from radixlm.cache.l2.store import L2Store
from radixlm.cache.l2.tree import TierMatch
from radixlm.cache.prefix_cache import PendingMatch
from radixlm.cache.tree_node import Namespace, TreeNode

log = logging.getLogger(__name__)

LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


@dataclass(eq=False)
class L2Load:
    """One chain being read into `slots` (tokens tm.l1.length .. tm.end)."""

    tm: TierMatch
    ids: np.ndarray  # the query
    slots: np.ndarray  # in flight until finish promotes or frees them
    futures: list[Future[bytearray | None] | None]  # per extent; None: known bad before reading
    sink: LoadSink
    started: float
    deadline: float
    done: bool = False  # finished or aborted: slots, lock and pins released

    def ready(self) -> bool:
        if self.done or time.perf_counter() >= self.deadline:
            return True
        return all(f is None or f.done() for f in self.futures)


@dataclass(eq=False)
class LoadTicket(PendingMatch):
    """A request's wait for a load (its own, or one it joined)."""

    load: L2Load
    ids: np.ndarray
    namespace: Namespace
    owner: bool  # started the load: its finish returns the promoted match itself

    def ready(self) -> bool:
        return self.load.ready()


class LoadRegistry:
    """The loads in flight, by the chain nodes they read, and the counters of all loads."""

    def __init__(self, store: L2Store, read_timeout_s: float = 1.0) -> None:
        self.store = store
        self.read_timeout_s = read_timeout_s  # per extent read; a slower one ends the load
        self._reading: dict[int, L2Load] = {}  # id(chain node) -> the load reading it
        self.hit_tokens = self.read_extents = self.bad_extents = self.read_timeouts = 0
        self.num_loads = self.aborted = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(LOAD_BUCKETS) + 1)  # the last one: above all bounds

    def reading(self, node: TreeNode) -> L2Load | None:
        """The load reading `node`, if one is."""
        return self._reading.get(id(node))

    @property
    def active(self) -> bool:
        return bool(self._reading)

    def start(
        self, ids: np.ndarray, namespace: Namespace, tm: TierMatch, slots: np.ndarray
    ) -> L2Load:
        """Submit the reads of `tm.chain` into `slots` (the caller pinned the chain, locked
        the prefix and allocated the slots)."""
        extents = [c for n in tm.chain if n.l2 is not None and n.l2.extents is not None
                  for c in n.l2.extents.tolist()]  # fmt: skip
        start, first = tm.l1.length, tm.l1.length // EXTENT_TOKENS
        keys = self.store.keys(namespace, ids[: tm.end], first + len(extents))
        sink = LoadSink(self.store.kv)
        futures: list[Future[bytearray | None] | None] = []
        for i, extent in enumerate(extents):
            t0 = (first + i) * EXTENT_TOKENS  # the extent's first token; the slots start at `start`
            copy = sink.extent(slots[max(t0, start) - start : t0 + EXTENT_TOKENS - start],
                              max(0, start - t0))  # fmt: skip
            ok = self.store.written(extent)
            futures.append(self.store.file.read(extent, keys[first + i], copy) if ok else None)
        now = time.perf_counter()
        load = L2Load(tm, ids, slots, futures, sink, now, now + self.read_timeout_s * len(extents))
        for node in tm.chain:
            self._reading[id(node)] = load
        return load

    def collect(self, load: L2Load) -> tuple[int, bool]:
        """Wait for the load's reads (until its deadline): how many leading extents arrived,
        and whether the next one was doubtful (a miss) rather than late (it stays on L2)."""
        done, bad = 0, False
        for future in load.futures:
            try:
                wait_s = max(0.0, load.deadline - time.perf_counter())
                data = None if future is None else future.result(wait_s)
            except FutureTimeout:
                self.read_timeouts += 1
                log.warning(
                    "L2 read slower than %.3f s an extent: recomputing", self.read_timeout_s
                )
                break
            if data is None:
                self.bad_extents += 1
                bad = True
                break
            done += 1
        return done, bad

    def end(self, load: L2Load) -> None:
        """No late read copies anything and no read not started runs; the load leaves the
        registry. Its pins, lock and slots are the caller's to release."""
        load.sink.cancel()
        for future in load.futures:
            if future is not None:
                future.cancel()  # not started: no I/O for extents nobody will use
        for node in load.tm.chain:
            self._reading.pop(id(node), None)
        load.done = True

    def observe(self, load: L2Load, num_extents: int, hit_tokens: int) -> None:
        """Count a finished load: its time, the extents read and the tokens it saved."""
        seconds = time.perf_counter() - load.started
        self.num_loads += 1
        self.seconds += seconds
        bucket = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
        self.buckets[bucket] += 1
        self.read_extents += num_extents
        self.hit_tokens += hit_tokens


def wait_any(tickets: list[LoadTicket], timeout_s: float) -> None:
    """Block until one of `tickets` may be ready (a read finished or a deadline passed)."""
    if not tickets or any(t.ready() for t in tickets):
        return
    pending = [f for t in tickets for f in t.load.futures if f is not None and not f.done()]
    until = min(t.load.deadline for t in tickets) - time.perf_counter()
    wait_futures(pending, timeout=max(0.0, min(timeout_s, until)), return_when=FIRST_COMPLETED)
