"""The radix tree over token ids that owns the KV cache (RadixAttention).

Each node is the lower end of an edge: `key` holds the edge's token ids and `value` their KV slot
ids, so the path from a namespace root to a node spells a cached sequence and owns its slots.

    root ── [sys prompt ........] ── [python repo ...] ─┬─ [auth code ..] ── [Fix this bug]
                                                         └─ [db code ....] ── [Optimize ...]

Ownership and invariants (check_integrity verifies each one):
- every tree-owned slot is in exactly one node's `value`; edges are whole pages;
- children are keyed by the first page of their edge, so siblings never share a first page;
- `lock_ref` counts the locks held on the node or below it; a locked node is never evicted;
- the eviction order holds exactly the unlocked leaves; evictable + protected = cached tokens;
- different namespaces (cache salts) hang under different roots and never share a node.

A lower tier (the disk, cache/l2/) extends the tree through two hooks, where a node crosses the
edge of RAM: `_leave_ram` (an evicted leaf leaves RAM) and `_below_ram` (an insert runs past
what RAM holds); it also extends `_split`, since what it keeps on a node divides with its edge.
The tree itself never reads what a lower tier keeps (`TreeNode.l2`).

Keys are stored as the raw bytes of int64 token ids. A query is turned into bytes once per call;
following an edge is then one `bytes.startswith` at an offset (a memcmp: no per-token Python loop,
no slice copy), and only the single edge where a walk diverges is searched with numpy for the
first differing token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from radixlm.cache.eviction import EvictionOrder, EvictionPolicy
from radixlm.cache.integrity import check_tree
from radixlm.cache.policies import make_policy
from radixlm.cache.tree_node import (
    DEFAULT_RETENTION,
    I64,
    NO_SLOTS,
    RAM_ONLY,
    TOKEN_BYTES,
    EvictResult,
    InsertResult,
    MatchResult,
    Namespace,
    TokenIds,
    TreeNode,
    TreeStats,
)
from radixlm.cache.turns import TurnTracker

__all__ = [
    "EvictResult",
    "InsertResult",
    "MatchResult",
    "Namespace",
    "RadixTree",
    "TreeNode",
    "TreeStats",
]


class RadixTree:
    """A radix tree of token ids whose nodes own KV slot ids, with LRU (pluggable) eviction."""

    def __init__(self, page_size: int = 1, policy: str | EvictionPolicy = "lru") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[Namespace, TreeNode] = {}
        self._order = EvictionOrder(make_policy(policy))
        self._touch = self._order.policy.touch
        self.turns = TurnTracker()  # conversation turns of new leaves (cache/turns.py)
        self._clock = 0  # ticks once per match/insert; the LRU time
        self.evictable_tokens = 0  # tokens in unlocked nodes
        self.protected_tokens = 0  # tokens in locked nodes
        self.num_nodes = 0
        self._num_queries = self._queried_tokens = self._hit_tokens = 0
        self._inserted_tokens = self._evicted_tokens = self._num_splits = 0
        # Called with each node just before it is evicted (a simulated L2, a test's check); None
        # by default. The record of evicted edges is `turns`, always on (cache/turns.py).
        self.eviction_listener: Callable[[TreeNode], None] | None = None

    @property
    def num_tokens(self) -> int:
        """Tree-owned tokens (= slots)."""
        return self.evictable_tokens + self.protected_tokens

    @property
    def policy(self) -> EvictionPolicy:
        return self._order.policy

    def root(self, namespace: Namespace = None) -> TreeNode:
        """The root of `namespace`, created on first use."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(b"", NO_SLOTS, None, 0, 0)
            root.namespace = namespace
        return root

    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        """The longest cached prefix of `tokens` in whole pages.

        Mutates: touches (LRU) every node on the matched path; when the match ends inside an
        edge it splits that edge so that the returned node ends exactly at the match. The
        caller must `lock(result.node)` before anything can evict, to keep the slots.
        """
        ids = tokens if tokens.__class__ is np.ndarray and tokens.dtype == I64 else _as_ids(tokens)
        buf = self._page_bytes_of(ids)
        self._clock += 1
        parts: list[np.ndarray] = []
        root = self._roots.get(namespace) or self.root(namespace)
        node, _ = self._walk(root, buf, self._clock, parts)
        length = node.depth
        self._num_queries += 1
        self._queried_tokens += len(ids)
        self._hit_tokens += length
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else NO_SLOTS
        return MatchResult(length, slots, node)

    def peek(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        """Length of the longest cached prefix (whole pages), changing nothing: no split, no
        LRU touch, no stats. For ordering queues; use `match` to actually reuse the prefix."""
        return self._peek(self._page_bytes_of(_as_ids(tokens)), namespace)[1]

    def _peek(self, buf: bytes, namespace: Namespace) -> tuple[TreeNode | None, int]:
        """`peek` of `buf` (int64 bytes, whole pages): the node the prefix ends at (None when
        it ends inside an edge, or the namespace has no root) and its length in tokens."""
        node = self._roots.get(namespace)
        if node is None:
            return None, 0
        pos, end, page_b = 0, len(buf), self._page_bytes
        while pos < end:
            child = node.children.get(buf[pos : pos + page_b])
            if child is None:
                break
            if not buf.startswith(child.key, pos):
                return None, pos // TOKEN_BYTES + self._common_len(child.key, buf, pos)
            pos += len(child.key)
            node = child
        return node, pos // TOKEN_BYTES

    @property
    def version(self) -> tuple[int, ...]:
        """Changes whenever tokens enter or leave the tree (a `peek` may then differ)."""
        return (self._inserted_tokens, self._evicted_tokens)

    def insert(
        self,
        tokens: TokenIds,
        slots: np.ndarray,
        namespace: Namespace = None,
        continues: TreeNode | None = None,
        retention: int = DEFAULT_RETENTION,
    ) -> InsertResult:
        """Add the whole pages of `tokens` with their `slots` (same length as `tokens`).

        Returns how many leading tokens were already cached: for those the tree keeps its own
        slots and the caller still owns (and must free) `slots[:prefix_len]` unless they are the
        tree's. The slots of the rest become tree-owned (a new leaf, or nodes a lower tier held
        without slots: `_below_ram`). Touches the path like match. `continues`: the node the
        same request inserted last; a new leaf right below it is that request's tail, not a new
        turn.
        `retention`: the request's (tree_node.RAM_ONLY / KEEP), given to a new leaf; a leaf
        below a RAM_ONLY node is RAM_ONLY too.
        """
        ids = tokens if tokens.__class__ is np.ndarray and tokens.dtype == I64 else _as_ids(tokens)
        if slots.__class__ is not np.ndarray or slots.dtype != I64:
            slots = np.asarray(slots, dtype=np.int64)
        if len(slots) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(slots)} slots")
        buf = self._page_bytes_of(ids)
        self._clock += 1
        tick = self._clock
        root = self._roots.get(namespace) or self.root(namespace)
        node, pos = self._walk(root, buf, tick, None)
        prefix_len = pos // TOKEN_BYTES
        if pos < len(buf):
            node, pos = self._below_ram(node, buf, pos, slots, tick)
        if pos < len(buf):
            end = len(buf) // TOKEN_BYTES
            ghost = self.turns.came_back(buf, pos, namespace)
            if continues is not None and node is continues:
                turn = node.turn  # the same request's output (or next chunk): the same turn
            else:
                turn = self.turns.turn_of_tail(node, buf, pos, ghost)
            leaf = self._add_leaf(node, buf[pos:], slots[pos // TOKEN_BYTES : end], tick, turn)
            if ghost is not None and ghost.memo is not None:
                self._order.policy.returned(ghost.memo, ghost.tick, tick)
            leaf.retention = RAM_ONLY if node.retention == RAM_ONLY else retention
            node = leaf
        return InsertResult(prefix_len, node)

    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its path to the root against eviction (a root needs no lock)."""
        if node.parent is None:
            return
        if node.depth < 0:
            raise ValueError("cannot lock an evicted node")
        node.own_locks += 1
        while node.parent is not None:
            if node.lock_ref == 0:
                size = len(node.value)
                self.evictable_tokens -= size
                self.protected_tokens += size
                if node.evict_seq:
                    self._order.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release one `lock(node)`. Raises ValueError if `node` holds no lock of its own."""
        if node.parent is None:
            return
        if node.own_locks <= 0:
            raise ValueError(f"unlock of {node!r}, which holds no lock")
        node.own_locks -= 1
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.value)
                self.evictable_tokens += size
                self.protected_tokens -= size
                if not node.children:
                    self._order.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> EvictResult:
        """Remove unlocked leaves in policy order until `num_tokens` are freed or none is left.

        A parent left as an unlocked leaf becomes a candidate. Returns the freed slots, which
        the caller gives back to the pool. O(log n) per evicted node.
        """
        freed: list[np.ndarray] = []
        num_freed = 0
        order, listener = self._order, self.eviction_listener
        evicted = order.policy.evicted
        while num_freed < num_tokens and order.num_members:
            node = order.pop()
            if listener is not None:
                listener(node)
            self.turns.evicted(node, self._clock, evicted(node, self._clock))
            num_freed += len(node.value)
            freed.append(node.value)
            self._leave_ram(node)
        self.evictable_tokens -= num_freed
        self._evicted_tokens += num_freed
        slots = freed[0] if len(freed) == 1 else np.concatenate(freed) if freed else NO_SLOTS
        return EvictResult(num_freed, len(freed), slots)

    def flush(self) -> EvictResult:
        """Evict every unlocked node."""
        return self.evict(self.evictable_tokens)

    def ends_path(self, node: TreeNode, tokens: TokenIds, namespace: Namespace = None) -> bool:
        """Whether `node` hangs in `namespace` and its path spells `tokens[:node.depth]`."""
        ids = _as_ids(tokens)
        if node.depth < 0 or node.depth > len(ids):
            return False
        buf = ids[: node.depth].tobytes()
        while node.parent is not None:
            if not buf.startswith(node.key, (node.depth - len(node.value)) * TOKEN_BYTES):
                return False
            node = node.parent
        return node.namespace == namespace

    def path_slots(self, node: TreeNode) -> np.ndarray:
        """The slot ids of the whole path from the root down to `node` (node.depth of them)."""
        parts: list[np.ndarray] = []
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else NO_SLOTS

    def stats(self) -> TreeStats:
        return TreeStats(
            self._num_queries,
            self._queried_tokens,
            self._hit_tokens,
            self._inserted_tokens,
            self._evicted_tokens,
            self._num_splits,
            self.num_nodes,
            self.evictable_tokens,
            self.protected_tokens,
        )

    def roots(self) -> dict[Namespace, TreeNode]:
        """The namespace roots (a copy of the mapping)."""
        return dict(self._roots)

    def eviction_order(self) -> EvictionOrder:
        return self._order

    def check_integrity(self) -> None:
        """Verify every invariant; raises IntegrityError naming the first broken one."""
        check_tree(self)

    # -- the lower tier's hooks ------------------------------------------------------------

    def _leave_ram(self, node: TreeNode) -> None:
        """Hook: an evicted leaf (its slots already counted as freed) leaves RAM. Here it leaves
        the tree; its parent may become an evictable leaf, or an empty tenant root is forgotten.
        A lower tier may keep the node instead."""
        parent = node.parent
        assert parent is not None  # roots are never members
        self._unlink(node)
        self._child_left_ram(parent)
        if parent.parent is None and not parent.children and parent.namespace is not None:
            self._roots.pop(parent.namespace, None)

    def _below_ram(
        self, node: TreeNode, buf: bytes, pos: int, slots: np.ndarray, tick: int
    ) -> tuple[TreeNode, int]:
        """Hook: an insert of `buf` (with `slots`) reached `node`, the end of what RAM holds,
        at byte `pos` with tokens left. Returns where a new leaf for the rest hangs, and from
        which byte; a lower tier may first give its nodes there the slots. Here: nothing."""
        return node, pos

    # -- helpers ---------------------------------------------------------------------------

    def _unlink(self, node: TreeNode) -> None:
        """Take a node without RAM children out of its parent's `children`; it is evicted."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self._page_bytes]]
        node.depth = -1
        self.num_nodes -= 1

    def _child_left_ram(self, parent: TreeNode) -> None:
        """`parent` lost a child in RAM: it may be an evictable leaf now."""
        if parent.children or parent.lock_ref or parent.evict_seq or parent.parent is None:
            return
        self._order.add(parent)

    def _page_bytes_of(self, ids: np.ndarray) -> bytes:
        """The whole pages of `ids` as bytes (the form keys are compared in)."""
        if self.page_size == 1:
            return ids.tobytes()
        return ids[: len(ids) // self.page_size * self.page_size].tobytes()

    def _walk(
        self, node: TreeNode, buf: bytes, tick: int, parts: list[np.ndarray] | None
    ) -> tuple[TreeNode, int]:
        """Follow `buf` (int64 bytes, whole pages) down from `node`, touching each node passed
        and collecting its slots into `parts`. Splits the edge where the walk diverges inside
        one. Returns the deepest node reached and the byte offset in `buf` where it ends."""
        pos, end, page_b = 0, len(buf), self._page_bytes
        while pos < end:
            child = node.children.get(buf[pos : pos + page_b])
            if child is None:
                break
            key = child.key
            if buf.startswith(key, pos):
                pos += len(key)
            else:
                # SGLang's LRU rule (kept so hit rates agree): the part below the split is touched
                child.last_access = tick
                common = self._common_len(key, buf, pos)
                child = self._split(child, common)
                pos = end = pos + common * TOKEN_BYTES  # the walk ends inside this edge
            child.last_access = tick
            if parts is not None:
                parts.append(child.value)
                child.hits += 1
            self._touch(child, tick)
            node = child
        return node, pos

    def _add_leaf(
        self, parent: TreeNode, key: bytes, slots: np.ndarray, tick: int, turn: int
    ) -> TreeNode:
        value = slots.copy()
        value.setflags(write=False)  # match may hand this array out without a copy
        leaf = TreeNode(key, value, parent, parent.depth + len(value), tick)
        leaf.turn = turn
        self._touch(leaf, tick)
        if parent.evict_seq:
            self._order.discard(parent)  # no longer a leaf
        parent.children[key[: self._page_bytes]] = leaf
        self._order.add(leaf)
        self.evictable_tokens += len(value)
        self._inserted_tokens += len(value)
        self.num_nodes += 1
        return leaf

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after `k` tokens. `child` keeps the lower part, its children and
        its identity (a held reference still ends where it did); a new parent takes the upper
        part and inherits the lock count. Slot arrays are divided, never copied."""
        parent = child.parent
        assert parent is not None
        cut = k * TOKEN_BYTES
        upper = TreeNode(child.key[:cut], child.value[:k], parent, child.start + k, 0)
        upper.last_access, upper.hits = child.last_access, child.hits
        upper.turn, upper.turn_below = child.turn, child.turn_below
        upper.priority = child.priority
        upper.retention = child.retention
        upper.lock_ref = child.lock_ref
        parent.children[child.key[: self._page_bytes]] = upper
        child.key = child.key[cut:]
        child.value = child.value[k:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        self.num_nodes += 1
        self._num_splits += 1
        return upper

    def _common_len(self, key: bytes, buf: bytes, pos: int) -> int:
        """Whole-page tokens that `key` shares with `buf[pos:]`; at least one page (the first
        page is the child's dict key). Only called on the one edge where a walk diverges."""
        n = min(len(key), len(buf) - pos) // TOKEN_BYTES
        a = np.frombuffer(key, dtype=np.int64, count=n)
        b = np.frombuffer(buf, dtype=np.int64, count=n, offset=pos)
        diff = a != b
        first = int(diff.argmax())
        common = first if diff[first] else n
        return common // self.page_size * self.page_size


def _as_ids(tokens: TokenIds) -> np.ndarray:
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64:
        return tokens
    return np.asarray(tokens, dtype=np.int64)
