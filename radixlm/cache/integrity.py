"""`check_tree`: verifies every structural invariant of a RadixTree by a full walk.

Used by tests after every operation and by `RadixTree.check_integrity()`; it is O(tree size),
so the serving path never calls it. Each failure raises IntegrityError naming the invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixlm.cache.tree_node import TOKEN_BYTES, TreeNode

if TYPE_CHECKING:
    from radixlm.cache.paged_tree import PagedTree
    from radixlm.cache.radix_tree import RadixTree


class IntegrityError(AssertionError):
    """A cache invariant does not hold; the message names it."""


def check_tree(tree: RadixTree) -> None:
    page = tree.page_size
    page_b = page * TOKEN_BYTES
    evictable = protected = num_nodes = 0
    members: dict[int, TreeNode] = {}  # evict_seq -> node, for every unlocked leaf
    all_slots: list[np.ndarray] = []
    for namespace, root in tree.roots().items():
        _require(root.parent is None, "links", f"root of {namespace!r} has a parent")
        _require(root.namespace == namespace, "namespaces", f"root of {namespace!r} is mislabeled")
        _require(root.depth == 0 and not root.key, "lengths", "a root has a non-empty edge")
        _require(root.lock_ref == 0 and root.evict_seq == 0, "lock counts", "a root is locked")
        stack = [root]
        while stack:
            node = stack.pop()
            below = 0
            for first, child in node.children.items():
                stack.append(child)
                below += child.lock_ref
                _check_edge(node, first, child, page, page_b)
                num_nodes += 1
                all_slots.append(child.value)
                if child.lock_ref:
                    protected += len(child.value)
                else:
                    evictable += len(child.value)
                if child.lock_ref == 0 and not child.children:
                    _require(child.evict_seq != 0, "eviction order", f"{child!r} is missing")
                    members[child.evict_seq] = child
                else:
                    _require(child.evict_seq == 0, "eviction order", f"{child!r} is not evictable")
            if node.parent is not None:
                _require(
                    node.lock_ref == node.own_locks + below,
                    "lock counts",
                    f"{node!r}: lock_ref != own locks {node.own_locks} + children's {below}",
                )
            _require(node.own_locks >= 0, "lock counts", f"{node!r} has negative own locks")
    _require(num_nodes == tree.num_nodes, "node count", f"{tree.num_nodes} != {num_nodes} found")
    _require(
        evictable == tree.evictable_tokens,
        "evictable sum",
        f"counter {tree.evictable_tokens} != {evictable} in unlocked nodes",
    )
    _require(
        protected == tree.protected_tokens,
        "protected sum",
        f"counter {tree.protected_tokens} != {protected} in locked nodes",
    )
    slots = np.concatenate(all_slots) if all_slots else np.empty(0, dtype=np.int64)
    _require(np.unique(slots).size == slots.size, "slot ownership", "a slot is in two nodes")
    _require(bool((slots >= 0).all()), "slot ownership", "a negative slot id")
    _check_order(tree, members)


def check_l2(tree: PagedTree) -> None:
    """The L2 tier's invariants (cache/tiered_tree.py) by a full walk over both tiers."""
    from radixlm.cache.paged_tree import PAGE_TOKENS, pages_ending_in, wants_tail_page

    page_b = tree.page_size * TOKEN_BYTES
    num_l2_nodes = 0
    members: set[int] = set()
    pages: list[np.ndarray] = []
    stack = list(tree.roots().values())
    while stack:
        node = stack.pop()
        _require(not node.children.keys() & node.l2_children.keys(), "child keys",
                 f"{node!r} files a first page under both tiers")  # fmt: skip
        stack.extend(node.children.values())
        stack.extend(node.l2_children.values())
        for first, child in node.l2_children.items():
            num_l2_nodes += 1
            _check_l2_only(node, first, child, tree.page_size, page_b, PAGE_TOKENS)
        kids = sum(
            c.pages is not None for c in [*node.children.values(), *node.l2_children.values()]
        )
        if node.parent is None:
            continue
        _require(node.l2_kids == kids, "L2 children", f"{node!r}: l2_kids {node.l2_kids} != {kids}")
        if node.pages is not None:
            expected = pages_ending_in(node)
            _require(expected <= len(node.pages) <= expected + wants_tail_page(node), "L2 pages",
                     f"{node!r} holds {len(node.pages)} pages, {expected} end in it")  # fmt: skip
            pages.append(node.pages)
        leaf = node.pages is not None and not kids and not node.l2_pinned
        _require(leaf == (node.l2_seq != 0), "L2 order", f"{node!r} membership is wrong")
        if leaf:
            members.add(id(node))
    _require(num_l2_nodes == tree.num_l2_nodes, "node count",
             f"{tree.num_l2_nodes} L2 nodes counted, {num_l2_nodes} found")  # fmt: skip
    ids = np.concatenate(pages) if pages else np.empty(0, dtype=np.int64)
    _require(np.unique(ids).size == ids.size, "page ownership", "a page is in two nodes")
    _require(ids.size == tree.num_l2_pages, "page count",
             f"{tree.num_l2_pages} pages counted, {ids.size} held")  # fmt: skip
    order = {id(n) for n in tree.l2_order.members()}
    _require(order == members and tree.l2_order.num_members == len(members), "L2 order",
             "the heap's members are not the L2 leaves")  # fmt: skip


def _check_l2_only(
    parent: TreeNode, first: bytes, child: TreeNode, page: int, page_b: int, page_tokens: int
) -> None:
    _require(child.parent is parent, "links", f"{child!r} does not point back to its parent")
    _require(first == child.key[:page_b], "child keys", f"{child!r} is filed under another key")
    _require(len(child.value) == 0 and not child.children, "tiers",
             f"{child!r} is on L2 only but holds slots or RAM children")  # fmt: skip
    _require(child.pages is not None, "tiers", f"{child!r} is on no tier")
    _require(child.lock_ref == 0 and child.own_locks == 0 and child.evict_seq == 0, "tiers",
             f"{child!r} is on L2 only but locked or in the RAM eviction order")  # fmt: skip
    _require(child.num_tokens > 0 and child.num_tokens % page == 0, "lengths",
             f"{child!r} is not whole pages")  # fmt: skip
    _require(child.depth == parent.depth + child.num_tokens, "lengths", f"{child!r} depth")
    from radixlm.cache.paged_tree import has_tail_page

    held = child.depth % page_tokens == 0 or child.l2_children or has_tail_page(child)
    _require(bool(held) or child.l2_pinned, "L2 tails",
             f"{child!r} keeps a tail that no page holds")  # fmt: skip


def _check_edge(parent: TreeNode, first: bytes, child: TreeNode, page: int, page_b: int) -> None:
    _require(child.parent is parent, "links", f"{child!r} does not point back to its parent")
    _require(first == child.key[:page_b], "child keys", f"{child!r} is filed under another key")
    size = len(child.value)
    _require(size > 0 and size % page == 0, "lengths", f"{child!r} is not whole pages")
    _require(len(child.key) == size * TOKEN_BYTES, "lengths", f"{child!r}: key and value differ")
    _require(child.value.dtype == np.int64, "lengths", f"{child!r} slots are not int64")
    _require(child.depth == parent.depth + size, "lengths", f"{child!r} has a wrong depth")
    _require(child.last_access <= parent.last_access or parent.parent is None, "access times",
             f"{child!r} was touched after its parent")  # fmt: skip


def _check_order(tree: RadixTree, members: dict[int, TreeNode]) -> None:
    order = tree.eviction_order()
    _require(order.num_members == len(members), "eviction order", "member count is off")
    live = 0
    for priority, seq, node in order.entries():
        if members.get(seq) is node:
            live += 1
            _require(
                priority <= order.policy.priority(node),
                "eviction order",
                f"{node!r} is filed with a priority above its current one",
            )
    _require(live == len(members), "eviction order", "an unlocked leaf has no heap entry")


def _require(ok: bool, invariant: str, detail: str) -> None:
    if not ok:
        raise IntegrityError(f"{invariant}: {detail}")
