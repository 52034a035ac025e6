"""Which conversation turn a new sequence is, and the one record of edges the tree evicted.

A sequence whose cached prefix is most of it continues a conversation: its new tail is one turn
deeper than the node it hangs under. But a cache under pressure has often evicted the earlier
turn by the time the next one arrives, and the tail would look like a new conversation. So
each evicted node leaves a *ghost* in the record: its namespace, where its edge starts and its
first tokens are the key; its turn, length and eviction time the value. Three readers:

- turn inference: a sequence whose walk stops where a ghost's edge started and that continues
  with the ghost's first GHOST_TOKENS tokens continues that conversation (ARC's ghost lists, for
  turns instead of frequencies). Eviction policies (cache/eviction.py) and the L2 write filter read
  `node.turn`; nothing else does, so a wrong guess costs hit rate, never correctness.
- the observatory's "evicted" reason (`evicted_run`): the evicted edges a prompt follows from
  where its match ended, chained edge by edge, in the prompt's own namespace only.
- the eviction policy that learns from its mistakes (cache/adaptive.py): what it returned from
  `evicted` is kept in the ghost as its `memo`, and handed back once (`came_back`) when a new
  leaf begins like the ghost's edge, with the tree tick of the eviction.

Rules: a ghost is keyed by its namespace, so no lookup ever sees another namespace's evictions
(a tenant cannot learn what another tenant's evicted prompts held). An edge is remembered by
where it started and how it began (its first GHOST_TOKENS ids, or all of a shorter edge), not
by its whole path (hashing the path would cost O(depth) per eviction), so a lookup is a strong
hint, not a proof. The record is a bounded FIFO of a few hundred bytes per ghost and holds no
KV; recording is one dict write per evicted node.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from radixlm.cache.tree_node import TOKEN_BYTES, Namespace, TreeNode

GHOST_TOKENS = 16  # tokens of an edge that identify it (all of a shorter edge)
MAX_GHOSTS = 1 << 16  # the oldest ghost is forgotten beyond this many

MAX_TURN = 8  # turns counted separately for return rates; deeper ones count as this one
MIN_SAMPLES = 64  # new conversations at a turn before its return rate is trusted

GhostKey = tuple[Namespace, int, bytes]  # (namespace, depth where the edge starts, its head)


class Ghost(NamedTuple):
    """What the record keeps of one evicted edge."""

    turn: int  # the deepest turn evicted at or below the edge
    length: int  # tokens on the whole edge
    evicted_at: float  # time.time() of the (latest) eviction
    tick: int  # the tree clock at that eviction
    memo: object  # what the eviction policy keeps of it until it comes back; None: nothing


class EvictedRun(NamedTuple):
    evicted_at: float  # the latest eviction among the edges found
    num_tokens: int  # prompt tokens after the match that evicted edges had held (a lower bound)


class TurnTracker:
    """Infers `turn` for new leaves; the record of evicted edges (see the module docstring).
    Not locked: the tree calls it inside insert and evict, and probes read it, all in the one
    thread that owns the tree (the engine thread)."""

    def __init__(self, max_ghosts: int = MAX_GHOSTS) -> None:
        self.max_ghosts = max_ghosts
        self._ghosts: dict[GhostKey, Ghost] = {}  # insertion order: oldest first
        self.new_leaves = [0] * (MAX_TURN + 2)  # new leaves (sequences) per inferred turn

    def __len__(self) -> int:
        return len(self._ghosts)

    def came_back(self, buf: bytes, pos: int, namespace: Namespace) -> Ghost | None:
        """The ghost of the edge that a new leaf, the tail of `buf` (int64 bytes) after its
        cached `pos` bytes, begins like, if any. Its memo is handed over once: the ghost keeps
        its place in the FIFO without it."""
        key = (namespace, pos // TOKEN_BYTES, buf[pos : pos + GHOST_TOKENS * TOKEN_BYTES])
        ghost = self._ghosts.get(key)
        if ghost is not None and ghost.memo is not None:
            self._ghosts[key] = ghost._replace(memo=None)
        return ghost

    def turn_of_tail(self, parent: TreeNode, buf: bytes, pos: int, ghost: Ghost | None) -> int:
        """The turn of a new leaf under `parent` for the sequence `buf` (int64 bytes) whose
        first `pos` bytes are cached; `ghost`: what `came_back` found for it."""
        turn = parent.turn + 1 if 2 * pos >= len(buf) else 1
        if ghost is not None and ghost.length >= GHOST_TOKENS:  # short edges name no turn
            turn = max(turn, ghost.turn + 1)
        self.new_leaves[min(turn, MAX_TURN + 1)] += 1
        return turn

    def return_rate(self, turn: int) -> float | None:
        """The share of sequences at `turn` that came back for another turn (measured: new
        leaves one turn deeper over new leaves at it), or None before MIN_SAMPLES of them."""
        turn = max(1, min(turn, MAX_TURN))
        seen = self.new_leaves[turn]
        return self.new_leaves[turn + 1] / seen if seen >= MIN_SAMPLES else None

    def evicted(self, node: TreeNode, tick: int, memo: object) -> None:
        """Leave a ghost of `node` (still attached: its path names the namespace), evicted at
        tree tick `tick`, with the eviction policy's `memo`. Leaves go first, so a ghost carries
        the deepest turn evicted below it: a conversation evicted down to its first edge still
        comes back at its latest turn."""
        turn = max(node.turn, node.turn_below)
        parent = node.parent
        assert parent is not None  # roots are never evicted
        if parent.turn_below < turn:
            parent.turn_below = turn
        root = parent
        while root.parent is not None:
            root = root.parent
        length = len(node.value)
        key = (root.namespace, node.depth - length, node.key[: GHOST_TOKENS * TOKEN_BYTES])
        older = self._ghosts.pop(key, None)  # re-entered at the young end of the FIFO
        if older is not None:
            turn = max(turn, older.turn)
        self._ghosts[key] = Ghost(turn, length, time.time(), tick, memo)
        if len(self._ghosts) > self.max_ghosts:
            del self._ghosts[next(iter(self._ghosts))]

    def evicted_run(self, ids: np.ndarray, start: int, namespace: Namespace) -> EvictedRun | None:
        """The evicted edges of `namespace` that `ids` (int64) follows from position `start` on,
        chained edge by edge (a leaf goes first, then its parent: the run is rebuilt from the
        top down). Each step tries the edge's longest possible head first (a long edge), then
        shorter ones (a short edge, whole): at most GHOST_TOKENS lookups. Reads only."""
        buf, n = ids.tobytes(), len(ids)
        pos, found, when = start, 0, 0.0
        while pos < n:
            ghost = None
            for k in range(min(GHOST_TOKENS, n - pos), 0, -1):
                ghost = self._ghosts.get(
                    (namespace, pos, buf[pos * TOKEN_BYTES : (pos + k) * TOKEN_BYTES])
                )
                if ghost is not None:
                    break
            if ghost is None:
                break
            # The head matched: the edge is counted whole (the rest of it is unseen, which is
            # why this is a hint), and the run goes on at the edge's end.
            step = min(ghost.length, n - pos)
            found += step
            pos += step
            when = max(when, ghost.evicted_at)
        return EvictedRun(when, found) if found else None
