"""NoCache: the prefix-cache interface without sharing, for the cache-off ablation.

Every match finds nothing and every slot stays in flight until `release`, so the slot account
of prefix_cache.py holds with no tree-owned slots: `num_free + num_in_flight == capacity`.
"""

from __future__ import annotations

import numpy as np

from radixlm.cache.prefix_cache import CacheStats, CommitResult, PrefixCache, SlotPool
from radixlm.cache.radix_tree import MatchResult, Namespace, RadixTree, TreeNode
from radixlm.cache.tree_node import DEFAULT_RETENTION, NO_SLOTS, TokenIds


class NoCache(PrefixCache):
    """The same interface with no sharing: match finds nothing, every slot stays in flight
    until `release`. Serves the cache-off ablation."""

    shares_prefixes = False

    def __init__(self, pool: SlotPool) -> None:
        super().__init__(pool)
        self._root = RadixTree().root()  # the node every match returns; locks are no-ops
        self._num_queries = self._queried_tokens = 0

    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        self._num_queries += 1
        self._queried_tokens += len(tokens)
        return MatchResult(0, NO_SLOTS, self._root)

    def peek(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        return 0

    @property
    def version(self) -> object:
        return 0

    def lock(self, node: TreeNode) -> None:
        """Nothing is shared, so nothing needs pinning."""

    def unlock(self, node: TreeNode) -> None:
        """Nothing is shared, so nothing was pinned."""

    def commit(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        namespace: Namespace,
        node: TreeNode,
        retention: int = DEFAULT_RETENTION,
    ) -> CommitResult:
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        return CommitResult(self._root, slots, 0)

    def release(self, node: TreeNode, in_flight_slots: np.ndarray, finished: bool = True) -> None:
        self._free_in_flight(np.asarray(in_flight_slots, dtype=np.int64))

    def evict(self, num_tokens: int) -> int:
        return 0

    @property
    def num_evictable(self) -> int:
        return 0

    @property
    def num_protected(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        return CacheStats(
            self._num_queries, self._queried_tokens, 0, 0, 0, 0,
            self.num_free, 0, 0, self.num_in_flight, self.capacity,
        )  # fmt: skip
