"""A node of the radix tree, and the NamedTuple results of the tree's operations.

`TreeNode` is the lower end of an edge: `key` holds the edge's token ids (int64 bytes) and
`value` their KV slot ids. Callers only hold nodes that they locked (or got from the match
they are about to lock); `depth` is -1 once a node was evicted.

With a disk tier (cache/l2/) a node carries that tier's state in one optional record, `l2`
(cache/l2/node.py); the radix tree itself never reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from radixlm.cache.l2.node import L2Node

Namespace = str | None
TokenIds = np.ndarray | Sequence[int]  # token ids as given; the tree compares int64 bytes
TOKEN_BYTES = 8  # token ids are int64
NO_SLOTS = np.empty(0, dtype=np.int64)
NO_SLOTS.setflags(write=False)
I64 = np.dtype(np.int64)

# A request's wish for how long its KV is kept (OpenAI's `prompt_cache_retention`), stamped on
# the nodes it inserts: RAM_ONLY ("in_memory") never goes to the disk tier, nor does anything
# below it; KEEP ("24h") is written to the disk tier when its request finishes.
RAM_ONLY, DEFAULT_RETENTION, KEEP = -1, 0, 1


class TreeNode:
    """A node and the edge above it. Hold one only while it is locked (or right after match)."""

    __slots__ = (
        "children",
        "depth",
        "evict_seq",
        "hits",
        "key",
        "l2",
        "last_access",
        "lock_ref",
        "namespace",
        "own_locks",
        "parent",
        "priority",
        "retention",
        "turn",
        "turn_below",
        "value",
    )

    def __init__(
        self, key: bytes, value: np.ndarray, parent: TreeNode | None, depth: int, tick: int
    ) -> None:
        self.key = key  # the edge's token ids as int64 bytes
        self.value = value  # the edge's slot ids, int64, read-only
        self.parent = parent  # None for a namespace root
        self.children: dict[bytes, TreeNode] = {}  # first page of the child's key -> child
        self.depth = depth  # tokens from the root to the end of this edge; -1 once evicted
        self.last_access = tick
        self.lock_ref = 0  # locks held on this node or any node below it
        self.own_locks = 0  # locks held on exactly this node
        self.evict_seq = 0  # != 0 while the node is in the eviction order
        self.namespace: Namespace = None  # meaningful on roots only
        self.hits = 0  # matches that walked through this node
        self.turn = 0  # inferred conversation turn of the request that inserted it; roots 0
        self.turn_below = 0  # the deepest turn among its evicted descendants (cache/turns.py)
        self.priority = 0  # kept by policies that store their priority (never lowered)
        self.retention = DEFAULT_RETENTION  # RAM_ONLY, DEFAULT_RETENTION or KEEP (above)
        self.l2: L2Node | None = None  # the disk tier's record (cache/l2/node.py), if any

    @property
    def num_tokens(self) -> int:
        """Tokens on the edge (its slots when in RAM; none of them when held on disk only)."""
        return len(self.key) // TOKEN_BYTES

    @property
    def start(self) -> int:
        """Tokens from the root to the start of this edge."""
        return self.depth - len(self.key) // TOKEN_BYTES

    @property
    def tokens(self) -> np.ndarray:
        """The edge's token ids (a read-only view)."""
        return np.frombuffer(self.key, dtype=np.int64)

    def __repr__(self) -> str:
        return f"TreeNode(depth={self.depth}, len={len(self.value)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    length: int  # tokens of the longest cached prefix (whole pages)
    slots: np.ndarray  # their slot ids, int64, shape (length,); may be read-only
    node: TreeNode  # the node that ends exactly at `length` (a namespace root when 0)


class InsertResult(NamedTuple):
    prefix_len: int  # leading tokens that were already cached (the caller's slots are unused)
    node: TreeNode  # the node that ends exactly at the end of the inserted whole pages


class EvictResult(NamedTuple):
    num_tokens: int
    num_nodes: int
    slots: np.ndarray  # the freed slot ids, to be returned to the pool


class TreeStats(NamedTuple):
    num_queries: int  # match calls
    queried_tokens: int
    hit_tokens: int  # tokens returned by match
    inserted_tokens: int  # tokens that became tree-owned
    evicted_tokens: int
    num_splits: int
    num_nodes: int  # namespace roots excluded
    evictable_tokens: int
    protected_tokens: int
