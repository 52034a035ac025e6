"""L2Store: where a tiered tree's extents live, and which nodes are worth writing there.

`ExtentStore` is what the tree (cache/l2/tree.py) asks of it; L2Store is the one on disk.

The tree (cache/l2/tree.py) decides which extents a node holds; the store decides what is written
(hands extents to the extent file's I/O threads, cache/l2/extent_file.py) and reads them back for
loads (cache/l2/loads.py). What is written follows two rules:
- The *write filter* (`worth_writing`): a node likely to be asked for again: a hit, a
  conversation's second turn or later, or a first turn once enough of them measurably came back
  (cache/turns.py).
- The *pressure rule* (`pressure_wants`), over the filter: while the file has free extents for
  a write, it is made whatever the filter says (the KV is computed already: a write costs a
  copy, a miss a recompute; a filter that refuses writes to a tier with free room loses hits
  for nothing); once the file is full, only a node the filter wants is written, and it may
  evict L2's least recently used leaves to make room. This is `bench cache`'s default rule
  (`pressure`, bench/l2_sim.py), the one measured against RAM alone (docs/cache.md). It
  decides both writes: a finished request's path is written through down to its deepest node
  the rule wants (room for the whole path, or the filter), and a node RAM evicts unwritten is
  written if the rule wants it (room for its extents, or the filter). Writing through while
  there is room keeps the copy off the engine thread (below): an eviction then only settles.
The client's `prompt_cache_retention` overrides both: `in_memory` is never written, `24h` always.

A finished request's path is written through: each extent's KV is gathered on an I/O thread
from slots the tree still owns (`StagedExtent`), and the tree calls `settle` before it frees any
of them, which waits only for a gather in progress (a memory copy) and copies one not started
yet itself. A node that leaves RAM unwritten is gathered on the engine thread, as its slots are
freed right after. An extent is reused only once its last write is done, and a failed write
(disk full) makes the extent a miss.

Accounting: free extents (the file's free list) + extents held by nodes == num_extents.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2.extent_copy import StagedExtent, gather_extent
from radixlm.cache.l2.extent_file import ExtentFile, extent_key
from radixlm.cache.l2.node import EXTENT_TOKENS
from radixlm.cache.tree_node import DEFAULT_RETENTION, KEEP, Namespace, TreeNode
from radixlm.cache.turns import TurnTracker

log = logging.getLogger(__name__)

WRITE_RETURN_RATE = 0.25  # a first turn is written once this share of first turns came back


class ExtentStore(Protocol):
    """Where a TieredTree's extents live (cache/l2/store.py)."""

    def worth_writing(self, node: TreeNode, turns: TurnTracker) -> bool:
        """Whether `node` is worth writing to L2 (likely to be asked for again)."""

    @property
    def num_free_extents(self) -> int: ...

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        """Write extents first .. first+count-1 of `node`'s path; the ids of the leading ones
        written (fewer when too few are free). `staged`: the KV is copied on the I/O thread,
        and the tree calls `settle(node)` before it frees a slot of the node."""

    def settle(self, node: TreeNode) -> None:
        """`node`, holding extents, leaves RAM: its staged extents' KV is copied out of its
        slots before they are freed."""

    def free_extents(self, extents: np.ndarray) -> None:
        """Give extents back once no node holds them."""


class L2Store:
    """The extents of one extent file for one KV pool (see the module docstring)."""

    def __init__(self, file: ExtentFile, kv: KVPool) -> None:
        self.file = file
        self.kv = kv
        self._pending: dict[int, Future[None]] = {}  # extent -> its last write
        self._staged: dict[int, StagedExtent] = {}  # extent -> its write through, until settled
        self._fingerprint = file.fingerprint  # in every extent key: another layout never matches
        self.written_extents = 0
        self.through_extents = 0  # written when a request finished, not when RAM evicted
        self.settled_extents = 0  # written through, but copied at eviction: not started yet

    # -- what the tree asks ----------------------------------------------------------------

    def worth_writing(self, node: TreeNode, turns: TurnTracker) -> bool:
        """The write filter: whether `node` is likely to be asked for again (the module)."""
        if node.retention != DEFAULT_RETENTION:  # the client said (RAM_ONLY or KEEP)
            return node.retention == KEEP
        if node.turn >= 2 or node.hits > 0:
            return True
        rate = turns.return_rate(node.turn)
        return rate is not None and rate >= WRITE_RETURN_RATE

    @property
    def num_free_extents(self) -> int:
        return self.file.num_free

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        """Write extents first .. first+count-1 of `node`'s path into free extents; the ids of the
        leading ones written (fewer when too few are free). Not `staged`: the KV is gathered
        now (the slots are freed next). `staged`: it is gathered on the I/O thread, and the
        tree calls `settle(node)` before it frees a slot of the node."""
        extents = [c for c in (self.file.alloc() for _ in range(count)) if c is not None]
        if not extents:
            return np.empty(0, dtype=np.int64)
        tokens, slots, namespace = _path(node)
        keys = self.keys(namespace, tokens, first + len(extents))
        for i, extent in enumerate(extents):
            c = first + i
            extent_slots = slots[c * EXTENT_TOKENS : (c + 1) * EXTENT_TOKENS]
            payload: Callable[[], memoryview | None] | memoryview
            if staged:
                stage = self._staged[extent] = StagedExtent(self.kv, extent_slots, keys[c])
                payload = stage.gather
            else:
                payload = gather_extent(self.kv, extent_slots)
            self._pending[extent] = self.file.write(extent, keys[c], payload)
        self.written_extents += len(extents)
        self.through_extents += len(extents) if staged else 0
        if len(self._pending) > 4 * self.file.num_extents // 3 + 64:
            self._pending = {c: f for c, f in self._pending.items() if not f.done()}
            self._staged = {c: s for c, s in self._staged.items() if c in self._pending}
        return np.array(extents, dtype=np.int64)

    def settle(self, node: TreeNode) -> None:
        """`node`, holding extents, leaves RAM: finish copying its staged extents' KV out of its
        slots (or copy it now) before they are freed."""
        assert node.l2 is not None and node.l2.extents is not None
        for extent in node.l2.extents.tolist():
            stage = self._staged.pop(extent, None)
            if stage is not None and not stage.settle():  # its write has not started: copy now
                payload = gather_extent(self.kv, stage.slots)
                self._pending[extent] = self.file.write(extent, stage.key, payload)
                self.settled_extents += 1

    def free_extents(self, extents: np.ndarray) -> None:
        """Give extents back once no node holds them."""
        for extent in extents.tolist():
            stage = self._staged.pop(extent, None)
            pending = self._pending.pop(extent, None)
            # An extent is reused only once its last write is done; a staged one that was not
            # copied yet never writes (no wait behind a slow disk for it).
            if pending is not None and (stage is None or stage.settle()):
                _wait(pending)
            self.file.free(extent)

    # -- what loads ask --------------------------------------------------------------------

    def keys(self, namespace: Namespace, tokens: np.ndarray, n: int) -> list[bytes]:
        """The chained keys of the first `n` extents of `tokens` (the last one partial when
        `tokens` ends inside it: a tail extent)."""
        keys: list[bytes] = []
        prev = None
        for c in range(n):
            extent_tokens = tokens[c * EXTENT_TOKENS : (c + 1) * EXTENT_TOKENS]
            prev = extent_key(self._fingerprint, namespace, extent_tokens, prev)
            keys.append(prev)
        return keys

    def written(self, extent: int) -> bool:
        """Whether `extent`'s last write is done and succeeded (a failed one is a miss)."""
        pending = self._pending.pop(extent, None)
        return pending is None or _wait(pending)

    def wait_writes(self) -> None:
        """Block until every write queued so far is done (tests; a failed one is logged)."""
        for pending in list(self._pending.values()):
            _wait(pending)

    def close(self) -> None:
        self.file.close()


def pressure_wants(
    store: ExtentStore, node: TreeNode, turns: TurnTracker, num_extents: int
) -> bool:
    """The pressure rule (the module): whether `node` is written, in a write of `num_extents`
    extents (its own as it leaves RAM, or a finished path's). Free room for all of them: yes,
    unless the client said otherwise; else the write filter decides (and the write may evict
    L2 to make room)."""
    if node.retention == DEFAULT_RETENTION and num_extents <= store.num_free_extents:
        return True
    return store.worth_writing(node, turns)


def _path(node: TreeNode) -> tuple[np.ndarray, np.ndarray, Namespace]:
    """The tokens and slots from the root down to `node`, and its namespace."""
    keys: list[bytes] = []
    values: list[np.ndarray] = []
    top = node
    while top.parent is not None:
        keys.append(top.key)
        values.append(top.value)
        top = top.parent
    tokens = np.frombuffer(b"".join(reversed(keys)), dtype=np.int64)
    slots = np.concatenate(values[::-1]) if values else np.empty(0, dtype=np.int64)
    return tokens, slots, top.namespace


def _wait(pending: Future[None]) -> bool:
    """Whether an extent write completed; a failed one (disk full) is logged and is a miss."""
    try:
        pending.result()
        return True
    except OSError as e:
        log.warning("L2 extent write failed (%s); the extent is a miss", e)
        return False


def fingerprint(pool: KVPool) -> bytes:
    """The KV layout extents are only valid for (the file is reinitialised at every start)."""
    return f"{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}/{pool.dtype}".encode()
