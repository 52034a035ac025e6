"""Which conversation turn a new sequence is: the tree's memory of conversations it evicted.

A sequence whose cached prefix is most of it continues a conversation: its new tail is one turn
deeper than the node it hangs under. But a cache under pressure has often evicted the earlier
turn by the time the next one arrives, and the tail would look like a new conversation. So
each evicted node leaves a *ghost*: its namespace, where its edge starts and its first tokens,
with its turn. A sequence whose walk stops where a ghost's edge started and continues with the
ghost's first tokens continues that conversation (ARC's ghost lists, for turns instead of
frequencies). Ghosts are a bounded FIFO of a few bytes each and hold no KV.

Eviction policies (cache/eviction.py) and L2 admission read `node.turn`; nothing else does, so
a wrong guess costs hit rate, never correctness.
"""

from __future__ import annotations

from radixlm.cache.tree_node import TOKEN_BYTES, Namespace, TreeNode

GHOST_TOKENS = 16  # tokens of an edge that identify it; shorter evicted edges leave no ghost
MAX_GHOSTS = 1 << 16  # the oldest ghost is forgotten beyond this many

MAX_TURN = 8  # turns counted separately for return rates; deeper ones count as this one
MIN_SAMPLES = 64  # new conversations at a turn before its return rate is trusted

GhostKey = tuple[Namespace, int, bytes]  # (namespace, depth where the edge starts, its tokens)


class TurnTracker:
    """Infers `turn` for new leaves; remembers the turns of evicted nodes (see the module)."""

    def __init__(self, max_ghosts: int = MAX_GHOSTS) -> None:
        self.max_ghosts = max_ghosts
        self._ghosts: dict[GhostKey, int] = {}
        self.new_leaves = [0] * (MAX_TURN + 2)  # new leaves (sequences) per inferred turn

    def __len__(self) -> int:
        return len(self._ghosts)

    def turn_of_tail(self, parent: TreeNode, buf: bytes, pos: int, namespace: Namespace) -> int:
        """The turn of a new leaf under `parent` for the sequence `buf` (int64 bytes) whose
        first `pos` bytes are cached."""
        turn = parent.turn + 1 if 2 * pos >= len(buf) else 1
        ghost = self._ghosts.get(_key(namespace, pos, buf))
        if ghost is not None:
            turn = max(turn, ghost + 1)
        self.new_leaves[min(turn, MAX_TURN + 1)] += 1
        return turn

    def return_rate(self, turn: int) -> float | None:
        """The share of sequences at `turn` that came back for another turn (measured: new
        leaves one turn deeper over new leaves at it), or None before MIN_SAMPLES of them."""
        turn = max(1, min(turn, MAX_TURN))
        seen = self.new_leaves[turn]
        return self.new_leaves[turn + 1] / seen if seen >= MIN_SAMPLES else None

    def evicted(self, node: TreeNode) -> None:
        """Leave a ghost of `node` (still attached: its path names the namespace). Leaves go
        first, so a ghost carries the deepest turn evicted below it: a conversation evicted
        down to its first edge still comes back at its latest turn."""
        turn = max(node.turn, node.turn_below)
        parent = node.parent
        assert parent is not None  # roots are never evicted
        if parent.turn_below < turn:
            parent.turn_below = turn
        if len(node.key) < GHOST_TOKENS * TOKEN_BYTES:
            return
        root = parent
        while root.parent is not None:
            root = root.parent
        start = (node.depth - len(node.value)) * TOKEN_BYTES
        key = _key(root.namespace, start, node.key, 0)
        older = self._ghosts.pop(key, 0)  # re-entered at the young end of the FIFO
        self._ghosts[key] = max(turn, older)
        if len(self._ghosts) > self.max_ghosts:
            del self._ghosts[next(iter(self._ghosts))]


def _key(namespace: Namespace, start: int, buf: bytes, offset: int | None = None) -> GhostKey:
    """The ghost key of an edge starting at byte `start` whose tokens begin at `buf[offset:]`
    (offset defaults to `start`: `buf` is the whole sequence)."""
    at = start if offset is None else offset
    return (namespace, start // TOKEN_BYTES, buf[at : at + GHOST_TOKENS * TOKEN_BYTES])
