"""The prefix cache: the radix tree plus the KV slot pool, as running requests use them.

It keeps the slot account of DESIGN.md: every slot is free (in the pool), tree-owned (a node's
value) or in flight (allocated to a request, not inserted), and

    num_free + num_tree_tokens + num_in_flight == capacity

after every call; `check_accounting()` verifies it against an independently kept in-flight
counter. A request's life, as the engine drives it:

    m = cache.match(prompt[:-1], ns); cache.lock(m.node)      # reuse; pin the prefix
    new = cache.alloc(n)                                      # in flight; may evict
    c = cache.commit(tokens, slots, ns, node)                 # after each prefill chunk / finish
    cache.release(c.node, c.slots[c.cached_len:])             # finish or abort

`RadixCache` shares prefixes through the tree it is given; `NoCache` (cache/no_cache.py) has the
same interface and never reuses (the ablation). `create_prefix_cache` (cache/__init__.py) builds
the one a config names, with a disk tier (cache/l2/) when it has one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

import numpy as np

from radixlm.cache.integrity import IntegrityError
from radixlm.cache.kv_pool import OutOfSlotsError
from radixlm.cache.radix_tree import MatchResult, Namespace, RadixTree, TreeNode
from radixlm.cache.tree_node import DEFAULT_RETENTION, TokenIds


class SlotPool(Protocol):
    """What the cache needs of a pool (KVPool and SlotAllocator both fit)."""

    @property
    def capacity(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    def alloc(self, n: int) -> np.ndarray: ...
    def free(self, slots: np.ndarray) -> None: ...


class CommitResult(NamedTuple):
    node: TreeNode  # now locked for the request (the lock on the old node was released)
    slots: np.ndarray  # the request's slots from now on: tree slots, then its in-flight tail
    cached_len: int  # leading tokens that are tree-owned (whole pages)


class CacheStats(NamedTuple):
    num_queries: int
    queried_tokens: int
    hit_tokens: int
    inserted_tokens: int
    evicted_tokens: int
    num_nodes: int
    num_free: int
    num_evictable: int
    num_protected: int
    num_in_flight: int
    capacity: int


class PendingMatch(ABC):
    """A match whose continuation is loading from a lower tier (cache/l2/loads.py). The
    caller keeps the request waiting until `ready()`, then calls `cache.finish_load`."""

    @abstractmethod
    def ready(self) -> bool: ...


class PrefixCache(ABC):
    """KV slots for requests, shared through cached prefixes. One engine thread calls it."""

    shares_prefixes: bool = True  # False for the no-cache ablation

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.num_in_flight = 0  # slots allocated to requests and not yet tree-owned

    @abstractmethod
    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        """The longest cached prefix (whole pages). May split a node; changes no slot's owner.
        The caller must lock `result.node` before the next alloc/evict to keep the slots."""

    @abstractmethod
    def peek(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        """The length `match` would return, changing nothing (for ordering the waiting queue)."""

    @property
    @abstractmethod
    def version(self) -> object:
        """A value that changes whenever a `peek` result may have changed."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors against eviction."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; raises ValueError if `node` holds no lock."""

    @abstractmethod
    def commit(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        namespace: Namespace,
        node: TreeNode,
        retention: int = DEFAULT_RETENTION,
    ) -> CommitResult:
        """Hand the whole pages of a request's computed `tokens` to the tree (new nodes get the
        request's `retention`, see tree_node.RAM_ONLY).

        The caller holds a lock on `node`, whose path is `tokens[:node.depth]` with exactly
        `slots[:node.depth]`; `slots[node.depth:]` are the request's in flight. Positions the
        tree already held with other slots (a concurrent request computed them first) are
        freed here. Locks the returned node and unlocks `node`.
        """

    @abstractmethod
    def release(self, node: TreeNode, in_flight_slots: np.ndarray, finished: bool = True) -> None:
        """The request is done (finished after its last commit, or aborted; `finished` False:
        retracted, it comes back): unlock `node` and free the slots it still holds in flight."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tree-owned slots if that many are evictable; returns how
        many were freed (whole nodes, so possibly more)."""

    @property
    @abstractmethod
    def num_evictable(self) -> int: ...

    @property
    @abstractmethod
    def num_protected(self) -> int: ...

    @property
    def num_tree_tokens(self) -> int:
        return self.num_evictable + self.num_protected

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def match_or_load(
        self, tokens: TokenIds, namespace: Namespace = None
    ) -> MatchResult | PendingMatch:
        """`match`, or, when the prefix continues in a lower tier, a load started in the
        background (its slots in flight, the prefix it extends locked): keep the request
        waiting until the load is `ready()`, then `finish_load` it. Without a lower tier,
        `match`."""
        return self.match(tokens, namespace)

    def finish_load(self, pending: PendingMatch) -> MatchResult:
        """The match of a ready load (see `match_or_load`); the same contract as `match`."""
        raise TypeError(f"{type(self).__name__} starts no loads")

    def wait_loads(self, pending: list[PendingMatch], timeout_s: float) -> None:
        """Block until one of `pending` may be ready, at most `timeout_s` (nothing to compute
        meanwhile)."""
        return None  # a cache without a lower tier never hands out a PendingMatch

    def alloc(self, n: int) -> np.ndarray:
        """`n` slots in flight for a request, evicting unlocked leaves (LRU) when the free list
        is short. Raises OutOfSlotsError, changing nothing, if free + evictable < n."""
        short = n - self.pool.num_free
        if short > 0:
            if short > self.num_evictable:
                raise OutOfSlotsError(n, self.pool.num_free + self.num_evictable)
            self.evict(short)
        slots = self.pool.alloc(n)
        self.num_in_flight += n
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Give back in-flight slots that never received KV (a forward pass that failed)."""
        self._free_in_flight(np.asarray(slots, dtype=np.int64))

    def flush(self) -> int:
        """Evict every unlocked node; returns the tokens freed."""
        return self.evict(self.num_evictable)

    def check_accounting(self) -> None:
        """Raise IntegrityError unless free + tree-owned + in flight == capacity."""
        total = self.num_free + self.num_tree_tokens + self.num_in_flight
        if self.num_in_flight < 0 or total != self.capacity:
            raise IntegrityError(
                f"accounting: free {self.num_free} + tree {self.num_tree_tokens} + in flight "
                f"{self.num_in_flight} = {total} != capacity {self.capacity}"
            )

    def check_integrity(self) -> None:
        """Every invariant of the tree, and the slot account."""
        self.check_accounting()

    @abstractmethod
    def stats(self) -> CacheStats: ...

    def _free_in_flight(self, slots: np.ndarray) -> None:
        self.pool.free(slots)
        self.num_in_flight -= len(slots)


class RadixCache(PrefixCache):
    """Prefix sharing through a RadixTree (RadixAttention): `tree`, or a new LRU tree of page
    size 1. The cache owns the tree from then on (only the cache calls it)."""

    def __init__(self, pool: SlotPool, tree: RadixTree | None = None) -> None:
        super().__init__(pool)
        self.tree = RadixTree() if tree is None else tree
        # id(node) -> running requests whose last commit returned it (they hold it locked, so
        # the id cannot be reused while counted here)
        self._heads: dict[int, int] = {}

    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        return self.tree.match(tokens, namespace)

    def peek(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        return self.tree.peek(tokens, namespace)

    @property
    def version(self) -> object:
        return self.tree.version

    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    # Who owns each region of a request's `slots` (positions in `tokens`) across one commit:
    #
    #   0               held              prefix_len            cached_len       len(tokens)
    #   |---- tree -----|---- in flight ----|----- in flight -----|--- in flight ---|  before
    #   |---- tree -----|-- tree (theirs) --|-------- tree -------|--- in flight ---|  after
    #    node's path,     a concurrent        inserted: the slots   a partial page:
    #    locked by the    request put these   become the tree's     the request's
    #    request          first: ours freed,                        until the next
    #                     the tree's returned                       commit
    #
    # held = node.depth; prefix_len = what the tree held already (>= held); cached_len = the
    # whole pages of `tokens`. The returned slots are the tree's up to cached_len, ours after.
    def commit(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        namespace: Namespace,
        node: TreeNode,
        retention: int = DEFAULT_RETENTION,
    ) -> CommitResult:
        slots = np.asarray(slots, dtype=np.int64)
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        tree = self.tree
        if not tree.ends_path(node, tokens, namespace):
            raise ValueError(f"{node!r} does not end a prefix of `tokens` in {namespace!r}")
        held = node.depth
        cached_len = len(tokens) // tree.page_size * tree.page_size
        # After a request's first commit, its next chunks and its output continue its turn
        continues = node if self._drop_head(node) else None
        inserted = tree.insert(
            tokens[:cached_len], slots[:cached_len], namespace, continues, retention
        )
        prefix_len = inserted.prefix_len
        tree.lock(inserted.node)
        tree.unlock(node)
        # slots[prefix_len:cached_len] became tree-owned; slots[held:prefix_len] are duplicates
        self.num_in_flight -= cached_len - prefix_len
        if prefix_len > held:
            self._free_in_flight(slots[held:prefix_len])
            # the node where the already-cached part ends: the new leaf's parent, if one was added
            anchor = inserted.node if inserted.node.depth == prefix_len else inserted.node.parent
            assert anchor is not None
            slots = np.concatenate([tree.path_slots(anchor), slots[prefix_len:]])
        key = id(inserted.node)
        self._heads[key] = self._heads.get(key, 0) + 1
        return CommitResult(inserted.node, slots, cached_len)

    def release(self, node: TreeNode, in_flight_slots: np.ndarray, finished: bool = True) -> None:
        self._drop_head(node)
        self.tree.unlock(node)
        self._free_in_flight(np.asarray(in_flight_slots, dtype=np.int64))

    def _drop_head(self, node: TreeNode) -> bool:
        """Forget one request's claim on `node` as its last commit; whether it had one."""
        count = self._heads.get(id(node), 0)
        if count > 1:
            self._heads[id(node)] = count - 1
        elif count:
            del self._heads[id(node)]
        return count > 0

    def evict(self, num_tokens: int) -> int:
        evicted = self.tree.evict(num_tokens)
        self.pool.free(evicted.slots)
        return evicted.num_tokens

    @property
    def num_evictable(self) -> int:
        return self.tree.evictable_tokens

    @property
    def num_protected(self) -> int:
        return self.tree.protected_tokens

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        self.check_accounting()

    def stats(self) -> CacheStats:
        s = self.tree.stats()
        return CacheStats(
            s.num_queries,
            s.queried_tokens,
            s.hit_tokens,
            s.inserted_tokens,
            s.evicted_tokens,
            s.num_nodes,
            self.num_free,
            self.num_evictable,
            self.num_protected,
            self.num_in_flight,
            self.capacity,
        )
