"""A bounded record of evicted tree edges, so a miss can say "the tree had this; evicted at T".

The tree calls `EvictionLog.record(node)` for each node it evicts (its eviction listener). The
record is O(1): the edge's start depth, its first `HEAD_TOKENS` token ids (bytes) and its
length, keyed by (start depth, first token) in an insertion-ordered dict that drops its oldest
entry past `capacity`. Rule: an edge is remembered by where it started and how it began, not by
its whole path (hashing the path would cost O(depth) per eviction), so a lookup is a strong hint,
not a proof; it also does not know the edge's namespace (a root is O(depth) away).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from radixlm.cache.tree_node import TOKEN_BYTES, TreeNode

HEAD_TOKENS = 32  # token ids kept per evicted edge: enough to tell prompts apart at one depth
_HEAD_BYTES = HEAD_TOKENS * TOKEN_BYTES


class EvictedEdge(NamedTuple):
    evicted_at: float  # time.time() of the eviction
    head: bytes  # the edge's first token ids (int64 bytes), at most HEAD_TOKENS
    length: int  # tokens on the whole edge


class EvictedRun(NamedTuple):
    evicted_at: float  # the latest eviction among the edges found
    num_tokens: int  # prompt tokens after the match that evicted edges had held (a lower bound)


class EvictionLog:
    """The last `capacity` evicted edges. Not locked: `record` runs inside the tree's evict and
    `lookup` inside a probe, both in the one thread that owns the tree (the engine thread)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        # oldest first; an OrderedDict drops its oldest in O(1), where a dict's first key is
        # found past every slot deleted before it
        self._edges: OrderedDict[tuple[int, bytes], EvictedEdge] = OrderedDict()

    def record(self, node: TreeNode) -> None:
        """Remember `node`'s edge (called before the tree marks it evicted)."""
        edges, key = self._edges, (node.depth - len(node.value), node.key[:TOKEN_BYTES])
        edges[key] = EvictedEdge(time.time(), node.key[:_HEAD_BYTES], len(node.value))
        edges.move_to_end(key)
        if len(edges) > self.capacity:
            edges.popitem(last=False)

    def lookup(self, ids: np.ndarray, start: int) -> EvictedRun | None:
        """Evicted edges that `ids` follows from position `start` on, chained edge by edge
        (a leaf goes first, then its parent: the run is rebuilt from the top down)."""
        pos, found, when = start, 0, 0.0
        while pos < len(ids):
            edge = self._edges.get((pos, ids[pos : pos + 1].tobytes()))
            if edge is None:
                break
            head = np.frombuffer(edge.head, dtype=np.int64)
            n = min(len(head), len(ids) - pos)
            eq = head[:n] == ids[pos : pos + n]
            same = n if eq.all() else int(eq.argmin())
            if same == 0:
                break
            when = max(when, edge.evicted_at)
            if same < len(head):  # the prompt leaves the edge (or ends) inside its head
                found += same
                break
            # The head matched whole: the edge is counted whole (the rest of it is unseen,
            # which is why this is a hint), and the run goes on at the edge's end.
            step = min(edge.length, len(ids) - pos)
            found += step
            pos += step
        return EvictedRun(when, found) if found else None

    def __len__(self) -> int:
        return len(self._edges)
