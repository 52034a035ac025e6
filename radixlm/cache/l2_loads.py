"""Loads from L2 that overlap compute.

A request whose match continues into L2 does not wait for the disk on the engine thread:

    start   lock the RAM prefix, pin the chain, allocate its slots (in flight), submit reads
    ready   every read finished, or the deadline passed (`read_timeout_s` a page)
    finish  take pages in order up to the first missing or late one, unpin, unlock, promote
            what arrived (tree-owned), free the other slots, forget a doubtful subtree
    abort   an insert reached the chain first (another request computed those tokens): the
            load ends at once and promotes nothing

Meanwhile the scheduler keeps the request waiting and other requests keep computing. Each
request holds a `LoadTicket`; requests whose match runs into a chain being loaded wait on the
same load (a chain is read once) and match again when it is done.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from radixlm.cache.page_copy import LoadSink
from radixlm.cache.prefix_cache import PendingMatch
from radixlm.cache.tiered_tree import TierMatch
from radixlm.cache.tree_node import Namespace


@dataclass(eq=False)
class L2Load:
    """One chain being read into `slots` (tokens tm.l1.length .. tm.end)."""

    tm: TierMatch
    ids: np.ndarray  # the query
    slots: np.ndarray  # in flight until finish promotes or frees them
    futures: list[Future[bytearray | None] | None]  # per page; None: known bad before reading
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


def wait_any(tickets: list[LoadTicket], timeout_s: float) -> None:
    """Block until one of `tickets` may be ready (a read finished or a deadline passed)."""
    if not tickets or any(t.ready() for t in tickets):
        return
    pending = [f for t in tickets for f in t.load.futures if f is not None and not f.done()]
    until = min(t.load.deadline for t in tickets) - time.perf_counter()
    wait_futures(pending, timeout=max(0.0, min(timeout_s, until)), return_when=FIRST_COMPLETED)
