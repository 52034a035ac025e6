"""Draft continuations read from the radix tree: where a run of tokens recurs in the cached paths
of one namespace, and what the tree holds after it.

The tree already holds every prompt and output the server has seen; a request that is about to
repeat some of it (a tool name and arguments, JSON keys, the code it is editing, the previous
step's plan) can take a draft from there. The tree is indexed by prefix, so a run that recurs in
the middle of another sequence needs a second index: `TreeDrafts` maps each run of NGRAM tokens
of a finished request's path to a position on that path (the node the path ended at when the
request finished, and the depth right after the run). The tokens themselves are never copied:
a continuation is read from the nodes' edges, walking up to the edge that holds the position
and down from there (below the recorded node, into the most recently used child).

Rules:
- Read only: nothing here changes the tree (no split, no LRU touch, no statistics). The index is
  this object's own state.
- Namespaces: every entry is filed under the namespace whose tree holds its node, a lookup reads
  only the caller's namespace, and a walk up or down stays inside that namespace's tree, so a
  draft never comes from another tenant's prompts or outputs.
- Staleness is harmless: an evicted node keeps its parent link, so a position under it is read
  from the first ancestor still in the tree, or dropped when that ancestor ends before it; a split
  keeps each node's path, so positions stay valid. A draft is only a guess the model verifies.
- Bounded: at most `max_positions` positions across namespaces; the oldest requests' go first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from radixlm.cache.tree_node import Namespace, TreeNode

NGRAM = 3  # tokens a run must share with the request's last tokens
ENTRIES_PER_RUN = 4  # positions kept per run, most recent last
MAX_POSITIONS = 1 << 18  # positions indexed across namespaces (a few tens of MB)
MAX_REMEMBERED = 4096  # the tail of a request's path that is indexed


class TreeSpot(NamedTuple):
    """A position on a cached path: the path ends at `node` (or ended, if it was evicted) and
    `depth` tokens from the root is where a continuation starts."""

    node: TreeNode
    depth: int


class _Remembered(NamedTuple):
    namespace: Namespace
    node: TreeNode
    keys: list[int]


def run_key(tokens: Sequence[int] | np.ndarray) -> int:
    """The index key of a run of NGRAM token ids (each below 2**21)."""
    a, b, c = (int(t) for t in tokens)
    return (a << 42) | (b << 21) | c


class TreeDrafts:
    """The NGRAM-run index over finished requests' paths (see the module docstring)."""

    def __init__(self, max_positions: int = MAX_POSITIONS) -> None:
        self.max_positions = max_positions
        self.num_positions = 0
        self._index: dict[Namespace, dict[int, list[TreeSpot]]] = {}
        self._order: deque[_Remembered] = deque()

    def remember(self, namespace: Namespace, node: TreeNode, ids: np.ndarray, start: int) -> None:
        """Index the path ending at `node` in `namespace`, which spells `ids[:node.depth]`,
        from position `start` on (what this request put in the tree: the rest was indexed by
        the request that inserted it). Reads nothing of the tree."""
        end = min(node.depth, len(ids))
        first = max(NGRAM, start, end - MAX_REMEMBERED)
        if end < first:
            return
        index = self._index.setdefault(namespace, {})
        window = np.lib.stride_tricks.sliding_window_view(ids[first - NGRAM : end], NGRAM)
        keys = ((window[:, 0] << 42) | (window[:, 1] << 21) | window[:, 2]).tolist()
        for depth, key in zip(range(first, end + 1), keys):
            spots = index.setdefault(key, [])
            spots.append(TreeSpot(node, depth))
            if len(spots) > ENTRIES_PER_RUN:
                del spots[0]
                self.num_positions -= 1
        self.num_positions += len(keys)
        self._order.append(_Remembered(namespace, node, keys))
        while self.num_positions > self.max_positions and len(self._order) > 1:
            self._forget(self._order.popleft())

    def lookup(self, namespace: Namespace, recent: Sequence[int] | np.ndarray) -> list[TreeSpot]:
        """The positions in `namespace` right after a run equal to the last NGRAM tokens of
        `recent`, most recent first (empty when there is none)."""
        if len(recent) < NGRAM:
            return []
        spots = self._index.get(namespace, {}).get(run_key(recent[-NGRAM:]))
        return spots[::-1] if spots else []

    def _forget(self, old: _Remembered) -> None:
        index = self._index.get(old.namespace, {})
        for key in old.keys:
            spots = index.get(key)
            if spots is None:
                continue
            kept = [s for s in spots if s.node is not old.node]
            self.num_positions -= len(spots) - len(kept)
            if kept:
                index[key] = kept
            else:
                del index[key]


def read_path(spot: TreeSpot, max_len: int) -> tuple[int, ...]:
    """Up to `max_len` tokens the tree holds from `spot` on: along the recorded path, then below
    it into the most recently used child at each node. Empty when the tree no longer holds the
    path up to `spot.depth`. Reads the tree only."""
    node: TreeNode | None = spot.node
    while node is not None and node.depth < 0:  # evicted: its path lives on in its ancestors
        node = node.parent
    if node is None or spot.depth > node.depth or max_len <= 0:
        return ()
    below = []  # the path's nodes from the one holding spot.depth down to `node`
    while node.parent is not None and node.start >= spot.depth:
        below.append(node)
        node = node.parent
    parts: list[np.ndarray] = []
    total = 0
    if node.depth > spot.depth:  # the edge that holds the position
        parts.append(node.tokens[spot.depth - node.start :])
        total = len(parts[0])
    for n in reversed(below):
        if total >= max_len:
            break
        parts.append(n.tokens)
        total += len(parts[-1])
        node = n
    while total < max_len and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        parts.append(node.tokens)
        total += len(parts[-1])
    if not parts:
        return ()
    return tuple(int(t) for t in np.concatenate(parts)[:max_len])
