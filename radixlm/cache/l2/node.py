"""A node's disk-tier record, the extent rules it follows, the L2 eviction order, and `check_l2`.

An *extent* is the disk tier's unit: the KV of EXTENT_TOKENS tokens at a fixed position of a
sequence (extent c holds tokens [64c, 64c + 64)). (A *page* is the tree's match grain,
`page_size` tokens, and a *chunk* is a piece of a prefill; the words never mix.) A node holds
either no extents or every extent that ends inside its edge. A leaf (no child on either tier)
whose end is not on an extent boundary may also hold a *tail extent*: the partial extent from
its last boundary to its end, so that a conversation's next turn loads everything its last turn
computed:

    tokens   0 .......... 64 .......... 128 .......... 192 .......... 256
    nodes    [ sys 0..100: L1 ][ turn 1 100..192: L1 + L2 ][ turn 2 192..256: L2 only ]
    extents    none (no copy)    extents 1, 2 (extent 1        extent 3
                                 holds sys's tokens 64..100)

Everything the disk tier keeps on a node is one optional `L2Node` record (`TreeNode.l2`, None
for a node the tier never touched). A node whose RAM slots were dropped hangs in its parent's
`l2.children` instead of `children`, so every walk over `children` sees exactly the RAM tier.

`check_l2` verifies these rules by a full walk over both tiers (the tree's own invariants are
`check_tree`'s, cache/integrity.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixlm.cache.integrity import require
from radixlm.cache.tree_node import NO_SLOTS, TOKEN_BYTES, TreeNode

if TYPE_CHECKING:
    from radixlm.cache.l2.tree import TieredTree

EXTENT_TOKENS = 64


@dataclass(slots=True, eq=False)
class L2Node:
    """The disk tier's state of one node."""

    extents: np.ndarray | None = None  # ids of the extents ending in the edge (+ a tail extent);
    # None: not on L2. An empty array: written, but no extent ends inside the edge
    children: dict[bytes, TreeNode] = field(default_factory=dict)  # children on L2 only
    kids: int = 0  # children (on either tier) that hold extents
    seq: int = 0  # != 0 while the node is in the L2 eviction order
    pinned: bool = False  # a load is reading this node's chain: not evictable from L2


def l2_of(node: TreeNode) -> L2Node:
    """`node`'s record, created on first use."""
    if node.l2 is None:
        node.l2 = L2Node()
    return node.l2


def extents_of(node: TreeNode) -> np.ndarray | None:
    """The extents `node` holds (None: it is not on L2)."""
    return None if node.l2 is None else node.l2.extents


def l2_children(node: TreeNode) -> dict[bytes, TreeNode]:
    """`node`'s children held on L2 only (an empty dict, not to be filled, when it has none)."""
    return _NO_CHILDREN if node.l2 is None else node.l2.children


def extents_ending_in(node: TreeNode) -> int:
    """The extents that end inside `node`'s edge."""
    return node.depth // EXTENT_TOKENS - node.start // EXTENT_TOKENS


def wants_tail_extent(node: TreeNode) -> bool:
    """Whether a write of `node` includes its tail extent: a leaf ending inside an extent."""
    return bool(node.depth % EXTENT_TOKENS) and not node.children and not l2_children(node)


def has_tail_extent(node: TreeNode) -> bool:
    extents = extents_of(node)
    return extents is not None and len(extents) > extents_ending_in(node)


def cut_edge(node: TreeNode, end: int) -> None:
    """Shorten the edge of a node without RAM children so that it ends at `end`."""
    node.key = node.key[: (end - node.start) * TOKEN_BYTES]
    node.value = node.value[: end - node.start] if len(node.value) else NO_SLOTS
    node.depth = end


def continuation_end(reached: int, last: TreeNode | None) -> int:
    """Where an L2 continuation that reached token `reached` ends: the end of `last` (the
    deepest node passed whole) when it holds its tail extent, else the last extent boundary."""
    if last is not None and reached == last.depth and has_tail_extent(last):
        return reached
    return reached // EXTENT_TOKENS * EXTENT_TOKENS


_NO_CHILDREN: dict[bytes, TreeNode] = {}


class L2Order:
    """Nodes that L2 may evict, least recently used first (a lazy min-heap on last_access,
    which never decreases). A node is a member iff `node.l2.seq != 0`."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._next_seq = 0
        self.num_members = 0

    def add(self, node: TreeNode) -> None:
        self._next_seq += 1
        l2_of(node).seq = self._next_seq
        heapq.heappush(self._heap, (node.last_access, self._next_seq, node))
        self.num_members += 1
        if len(self._heap) > 2 * self.num_members + 1024:  # drop stale entries in bulk
            live = [(n.last_access, s, n) for _, s, n in self._heap if _seq(n) == s]
            heapq.heapify(live)
            self._heap = live

    def discard(self, node: TreeNode) -> None:
        l2_of(node).seq = 0
        self.num_members -= 1

    def pop(self) -> TreeNode:
        while True:
            tick, seq, node = heapq.heappop(self._heap)
            if _seq(node) != seq:
                continue
            if node.last_access != tick:
                heapq.heappush(self._heap, (node.last_access, seq, node))
                continue
            self.discard(node)
            return node

    def members(self) -> list[TreeNode]:
        return [n for _, s, n in self._heap if _seq(n) == s]


def _seq(node: TreeNode) -> int:
    return 0 if node.l2 is None else node.l2.seq


def check_l2(tree: TieredTree) -> None:
    """The rules above, and the tree's L2 counters, by a full walk over both tiers: a node
    without slots holds extents, no lock and only L2 children, and ends on an extent boundary,
    holds its tail extent, or has a child (whose first extent holds its tail); only a node
    without children holds a tail extent; RAM nodes form a subtree at each root; the L2 order
    holds exactly the unpinned nodes with extents and no child with extents; the extent counter
    is the extents held."""
    page_b = tree.page_size * TOKEN_BYTES
    num_l2_nodes = 0
    members: set[int] = set()
    held: list[np.ndarray] = []
    stack = list(tree.roots().values())
    while stack:
        node = stack.pop()
        below = l2_children(node)
        require(not node.children.keys() & below.keys(), "child keys",
                f"{node!r} files a first page under both tiers")  # fmt: skip
        stack.extend(node.children.values())
        stack.extend(below.values())
        for first, child in below.items():
            num_l2_nodes += 1
            _check_l2_only(node, first, child, tree.page_size, page_b)
        kids = sum(extents_of(c) is not None for c in [*node.children.values(), *below.values()])
        if node.parent is None:
            continue
        record = node.l2
        require(record is not None or kids == 0, "L2 children", f"{node!r} has no record")
        if record is None:
            continue
        require(record.kids == kids, "L2 children", f"{node!r}: kids {record.kids} != {kids}")
        if record.extents is not None:
            expected = extents_ending_in(node)
            count = len(record.extents)
            require(expected <= count <= expected + wants_tail_extent(node), "L2 extents",
                    f"{node!r} holds {count} extents, {expected} end in it")  # fmt: skip
            held.append(record.extents)
        leaf = record.extents is not None and not kids and not record.pinned
        require(leaf == (record.seq != 0), "L2 order", f"{node!r} membership is wrong")
        if leaf:
            members.add(id(node))
    require(num_l2_nodes == tree.num_l2_nodes, "node count",
            f"{tree.num_l2_nodes} L2 nodes counted, {num_l2_nodes} found")  # fmt: skip
    ids = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    require(np.unique(ids).size == ids.size, "extent ownership", "an extent is in two nodes")
    require(ids.size == tree.num_l2_extents, "extent count",
            f"{tree.num_l2_extents} extents counted, {ids.size} held")  # fmt: skip
    order = {id(n) for n in tree.l2_order.members()}
    require(order == members and tree.l2_order.num_members == len(members), "L2 order",
            "the heap's members are not the L2 leaves")  # fmt: skip


def _check_l2_only(parent: TreeNode, first: bytes, child: TreeNode, page: int, page_b: int) -> None:
    require(child.parent is parent, "links", f"{child!r} does not point back to its parent")
    require(first == child.key[:page_b], "child keys", f"{child!r} is filed under another key")
    require(len(child.value) == 0 and not child.children, "tiers",
            f"{child!r} is on L2 only but holds slots or RAM children")  # fmt: skip
    require(extents_of(child) is not None, "tiers", f"{child!r} is on no tier")
    require(child.lock_ref == 0 and child.own_locks == 0 and child.evict_seq == 0, "tiers",
            f"{child!r} is on L2 only but locked or in the RAM eviction order")  # fmt: skip
    require(child.num_tokens > 0 and child.num_tokens % page == 0, "lengths",
            f"{child!r} is not whole pages")  # fmt: skip
    require(child.depth == parent.depth + child.num_tokens, "lengths", f"{child!r} depth")
    pinned = child.l2 is not None and child.l2.pinned
    ends = child.depth % EXTENT_TOKENS == 0 or l2_children(child) or has_tail_extent(child)
    require(bool(ends) or pinned, "L2 tails", f"{child!r} keeps a tail that no extent holds")
