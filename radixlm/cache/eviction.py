"""Which evictable leaf goes first: eviction policies and the incrementally kept eviction order.

The tree keeps every *evictable leaf* (an unlocked node without children) in an `EvictionOrder`,
a binary heap keyed by the policy's priority, so `pop()` costs O(log n) and nothing ever walks
the whole tree. The heap is lazy: `discard` only clears the node's `evict_seq` (the entry
turns stale and is skipped when it surfaces), and a node whose priority grew since it was
pushed (an LRU touch) is pushed again when it surfaces. That is exact as long as a node's
priority never decreases, which every policy here guarantees.

Invariant: a node is a member iff `node.evict_seq != 0`, and every member has exactly one heap
entry carrying its `evict_seq`, whose priority is <= the node's current priority.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixlm.cache.tree_node import TreeNode


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the smallest priority is evicted first.

    Contract: a node's priority never decreases while it stays in the tree (the lazy heap relies
    on it). Priorities are integers so that heap entries compare cheaply.
    """

    name: str

    def priority(self, node: TreeNode) -> int: ...


class LRUPolicy:
    """Least recently used first: the priority is the tree clock tick of the last match/insert
    that walked through the node. A parent is touched whenever its child is, so a parent that
    becomes a leaf never jumps ahead of older leaves."""

    name = "lru"

    def priority(self, node: TreeNode) -> int:
        return node.last_access


POLICIES: dict[str, type[LRUPolicy]] = {"lru": LRUPolicy}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from its name (see POLICIES) or the instance itself."""
    if not isinstance(policy, str):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {sorted(POLICIES)}")
    return POLICIES[policy]()


class EvictionOrder:
    """The evictable leaves of one tree in policy order (a lazy min-heap)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._priority = policy.priority
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._next_seq = 0
        self.num_members = 0
        self._compact_above = 1024  # heap length that triggers dropping stale entries

    def __len__(self) -> int:
        return self.num_members

    def add(self, node: TreeNode) -> None:
        """Make `node` a member. The caller guarantees it is an unlocked leaf, not yet a member."""
        self._next_seq += 1
        node.evict_seq = self._next_seq
        heapq.heappush(self._heap, (self._priority(node), self._next_seq, node))
        self.num_members += 1
        if len(self._heap) > self._compact_above:
            self._compact()

    def discard(self, node: TreeNode) -> None:
        """Stop considering `node` (it got a child or a lock). The caller guarantees membership."""
        node.evict_seq = 0
        self.num_members -= 1

    def pop(self) -> TreeNode:
        """Remove and return the member with the smallest priority. Raises IndexError if empty."""
        if self.num_members == 0:
            raise IndexError("no evictable leaf")
        heap = self._heap
        while True:
            priority, seq, node = heapq.heappop(heap)
            if node.evict_seq != seq:
                continue  # stale: discarded, or re-added under a newer seq
            current = self._priority(node)
            if current != priority:
                heapq.heappush(heap, (current, seq, node))
                continue
            node.evict_seq = 0
            self.num_members -= 1
            return node

    def entries(self) -> Iterator[tuple[int, int, TreeNode]]:
        """Every heap entry, stale ones included (for integrity checks)."""
        return iter(self._heap)

    def _compact(self) -> None:
        live = [(self._priority(n), s, n) for _, s, n in self._heap if n.evict_seq == s]
        heapq.heapify(live)
        self._heap = live
        # Stale entries are dropped in bulk once they may outnumber the live ones: amortised O(1).
        self._compact_above = 2 * len(live) + 1024
