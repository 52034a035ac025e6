"""Which evictable leaf goes first: eviction policies and the incrementally kept eviction order.

The tree keeps every *evictable leaf* (an unlocked node without children) in an `EvictionOrder`,
a binary heap keyed by the policy's priority, so `pop()` costs O(log n) and nothing ever walks
the whole tree. The heap is lazy: `discard` only clears the node's `evict_seq` (the entry
turns stale and is skipped when it surfaces), and a node whose priority grew since it was
pushed (an LRU touch) is pushed again when it surfaces. That is exact as long as a node's
priority never decreases, which every policy here guarantees.

Invariant: a node is a member iff `node.evict_seq != 0`, and every member has exactly one heap
entry carrying its `evict_seq`, whose priority is <= the node's current priority. (The disk
tier keeps the same kind of heap for its own leaves: `L2Order`, cache/l2/node.py.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixlm.cache.tree_node import TreeNode


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the smallest priority is evicted first.

    Contract: a node's priority never decreases while it stays in the tree (the lazy heap relies
    on it). Priorities are integers so that heap entries compare cheaply. The tree calls the
    hooks; a policy may keep its state in `node.priority`, in itself, and in the memo it leaves
    in the tree's one record of evicted edges (cache/turns.py), nowhere else.
    """

    name: str

    def priority(self, node: TreeNode) -> int: ...

    def touch(self, node: TreeNode, tick: int) -> None:
        """A match or insert walked through `node` at `tick` (after `last_access`/`hits`)."""

    def evicted(self, node: TreeNode, tick: int) -> object:
        """`node` left the tree at `tick`. Returns what the record keeps of it for the policy
        (its memo), or None for nothing."""

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """A new leaf at `tick` begins like an edge evicted at `evicted_tick` whose memo was
        `memo` (never None). Called at most once per memo, after the leaf's first touch."""


class LRUPolicy:
    """Least recently used first: the priority is the tree clock tick of the last match/insert
    that walked through the node. A parent is touched whenever its child is, so a parent that
    becomes a leaf never jumps ahead of older leaves."""

    name = "lru"

    def priority(self, node: TreeNode) -> int:
        return node.last_access

    def touch(self, node: TreeNode, tick: int) -> None:
        """Nothing to keep: the tree sets node.last_access itself."""

    def evicted(self, node: TreeNode, tick: int) -> None:
        """Nothing to forget: LRU remembers no evicted node."""

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """Never called: LRU leaves no memo."""


class TurnCreditPolicy:
    """LRU with a credit for conversations that come back: priority = last access + level x
    `credit` x the cache's turnover time (ticks an unpromoted node lives from its last access
    to its eviction, a running mean). level = min(`max_level`, turn - 1 + (1 if hit)): a node of
    a later turn, or one that was matched again, is likely to be asked for again, while most
    first turns never return. The credit is frozen into `node.priority` at each touch (never
    lowered), so a turnover that shrinks later cannot decrease a priority."""

    name = "turn-credit"

    def __init__(self, credit: float = 7.5, max_level: int = 8) -> None:
        if credit < 0 or max_level < 0:
            raise ValueError("credit and max_level must be >= 0")
        self.credit = credit
        self.max_level = max_level
        self.turnover = 0.0  # ticks; 0 until the first eviction: no credit before pressure

    def level(self, node: TreeNode) -> int:
        return min(self.max_level, node.turn - 1 + (node.hits > 0))

    def priority(self, node: TreeNode) -> int:
        return node.priority

    def touch(self, node: TreeNode, tick: int) -> None:
        value = tick + int(self.level(node) * self.credit * self.turnover)
        if value > node.priority:
            node.priority = value

    def evicted(self, node: TreeNode, tick: int) -> None:
        if self.level(node) == 0:  # only unpromoted nodes measure how long plain LRU keeps one
            self.turnover += (tick - node.last_access - self.turnover) / 64

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """Never called: turn credit leaves no memo."""


class GDSFPolicy:
    """Greedy-Dual-Size-Frequency with recompute cost: priority = L + uses x cost / size, where
    uses = turn + hits (the conversation's earlier turns count as earlier uses of its prefix),
    cost / size is the mean prefill cost of one token of the node's span and L (the GDSF clock)
    is the largest priority evicted so far. A token at position p costs the model's
    linear work plus attention over p earlier tokens, so deeper prefixes cost more to recompute
    and stay longer. L only grows and is added at each touch, which ages untouched nodes and
    keeps every priority non-decreasing (a touch never lowers `node.priority`)."""

    name = "gdsf"
    SCALE = 1000  # priority units per unit of per-token cost (priorities are integers)

    def __init__(self, attn_tokens: float = 3900.0) -> None:
        # Position at which a token's attention work equals its linear work. The default model:
        # ~2 x 135M FLOPs of matmuls per token, 4 x 30 layers x 9 heads x 64 FLOPs per position.
        if attn_tokens <= 0:
            raise ValueError("attn_tokens must be > 0")
        self.attn_tokens = attn_tokens
        self.clock = 0

    def cost_per_token(self, node: TreeNode) -> float:
        mid = node.depth - len(node.value) / 2  # mean position of the span
        return 1.0 + mid / self.attn_tokens

    def priority(self, node: TreeNode) -> int:
        return node.priority

    def touch(self, node: TreeNode, tick: int) -> None:
        uses = max(1, node.turn) + node.hits
        value = self.clock + int(uses * self.SCALE * self.cost_per_token(node))
        if value > node.priority:
            node.priority = value

    def evicted(self, node: TreeNode, tick: int) -> None:
        if node.priority > self.clock:
            self.clock = node.priority

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """Never called: GDSF leaves no memo."""


class EvictionOrder:
    """The evictable leaves of one tree in policy order (a lazy min-heap).

    A policy with `experts` (cache/adaptive.py) gets one heap per expert, each in that expert's
    order, and `choose()` names the heap the next pop takes from; a member has one entry in
    each, and a pop from one leaves the others' stale (they carry its old `evict_seq`)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        experts: tuple[EvictionPolicy, ...] = getattr(policy, "experts", (policy,))
        self._priorities = [e.priority for e in experts]
        self._heaps: list[list[tuple[int, int, TreeNode]]] = [[] for _ in experts]
        self._choose: Callable[[], int] | None = getattr(policy, "choose", None)
        self._next_seq = 0
        self.num_members = 0
        self._compact_above = 1024  # heap length that triggers dropping stale entries

    def __len__(self) -> int:
        return self.num_members

    def add(self, node: TreeNode) -> None:
        """Make `node` a member. The caller guarantees it is an unlocked leaf, not yet a member."""
        self._next_seq += 1
        node.evict_seq = seq = self._next_seq
        for priority, heap in zip(self._priorities, self._heaps, strict=True):
            heapq.heappush(heap, (priority(node), seq, node))
        self.num_members += 1
        if len(self._heaps[0]) > self._compact_above:
            self._compact()

    def discard(self, node: TreeNode) -> None:
        """Stop considering `node` (it got a child or a lock). The caller guarantees membership."""
        node.evict_seq = 0
        self.num_members -= 1

    def pop(self) -> TreeNode:
        """Remove and return the member with the smallest priority (in the order `choose()`
        names, with experts). Raises IndexError if empty."""
        if self.num_members == 0:
            raise IndexError("no evictable leaf")
        k = 0 if self._choose is None else self._choose()
        heap, priority_of = self._heaps[k], self._priorities[k]
        while True:
            priority, seq, node = heapq.heappop(heap)
            if node.evict_seq != seq:
                continue  # stale: discarded, or re-added under a newer seq
            current = priority_of(node)
            if current != priority:
                heapq.heappush(heap, (current, seq, node))
                continue
            node.evict_seq = 0
            self.num_members -= 1
            return node

    def entries(self) -> Iterator[tuple[int, int, TreeNode, int]]:
        """Every heap entry, stale ones included, with the node's current priority in that
        heap's order: (filed priority, seq, node, current priority). For integrity checks."""
        for priority_of, heap in zip(self._priorities, self._heaps, strict=True):
            for priority, seq, node in heap:
                yield priority, seq, node, priority_of(node)

    @property
    def num_heaps(self) -> int:
        return len(self._heaps)

    def _compact(self) -> None:
        for k, priority_of in enumerate(self._priorities):
            live = [(priority_of(n), s, n) for _, s, n in self._heaps[k] if n.evict_seq == s]
            heapq.heapify(live)
            self._heaps[k] = live
        # Stale entries are dropped in bulk once they may outnumber the live ones: amortised O(1).
        self._compact_above = 2 * len(self._heaps[0]) + 1024
