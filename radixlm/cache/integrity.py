"""`check_tree`: verifies every structural invariant of a RadixTree by a full walk.

Used by tests after every operation and by `RadixTree.check_integrity()`; it is O(tree size),
so the serving path never calls it. Each failure raises IntegrityError naming the invariant
(`require`, which the disk tier's `check_l2` in cache/l2/node.py uses too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixlm.cache.tree_node import TOKEN_BYTES, TreeNode

if TYPE_CHECKING:
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
        require(root.parent is None, "links", f"root of {namespace!r} has a parent")
        require(root.namespace == namespace, "namespaces", f"root of {namespace!r} is mislabeled")
        require(root.depth == 0 and not root.key, "lengths", "a root has a non-empty edge")
        require(root.lock_ref == 0 and root.evict_seq == 0, "lock counts", "a root is locked")
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
                    require(child.evict_seq != 0, "eviction order", f"{child!r} is missing")
                    members[child.evict_seq] = child
                else:
                    require(child.evict_seq == 0, "eviction order", f"{child!r} is not evictable")
            if node.parent is not None:
                require(
                    node.lock_ref == node.own_locks + below,
                    "lock counts",
                    f"{node!r}: lock_ref != own locks {node.own_locks} + children's {below}",
                )
            require(node.own_locks >= 0, "lock counts", f"{node!r} has negative own locks")
    require(num_nodes == tree.num_nodes, "node count", f"{tree.num_nodes} != {num_nodes} found")
    require(
        evictable == tree.evictable_tokens,
        "evictable sum",
        f"counter {tree.evictable_tokens} != {evictable} in unlocked nodes",
    )
    require(
        protected == tree.protected_tokens,
        "protected sum",
        f"counter {tree.protected_tokens} != {protected} in locked nodes",
    )
    slots = np.concatenate(all_slots) if all_slots else np.empty(0, dtype=np.int64)
    require(np.unique(slots).size == slots.size, "slot ownership", "a slot is in two nodes")
    require(bool((slots >= 0).all()), "slot ownership", "a negative slot id")
    _check_order(tree, members)


def _check_edge(parent: TreeNode, first: bytes, child: TreeNode, page: int, page_b: int) -> None:
    require(child.parent is parent, "links", f"{child!r} does not point back to its parent")
    require(first == child.key[:page_b], "child keys", f"{child!r} is filed under another key")
    size = len(child.value)
    require(size > 0 and size % page == 0, "lengths", f"{child!r} is not whole pages")
    require(len(child.key) == size * TOKEN_BYTES, "lengths", f"{child!r}: key and value differ")
    require(child.value.dtype == np.int64, "lengths", f"{child!r} slots are not int64")
    require(child.depth == parent.depth + size, "lengths", f"{child!r} has a wrong depth")
    require(child.last_access <= parent.last_access or parent.parent is None, "access times",
             f"{child!r} was touched after its parent")  # fmt: skip


def _check_order(tree: RadixTree, members: dict[int, TreeNode]) -> None:
    order = tree.eviction_order()
    require(order.num_members == len(members), "eviction order", "member count is off")
    live = 0
    for priority, seq, node, current in order.entries():
        if members.get(seq) is node:
            live += 1
            require(priority <= current, "eviction order",
                    f"{node!r} is filed with a priority above its current one")  # fmt: skip
    require(live == len(members) * order.num_heaps, "eviction order",
            "an unlocked leaf has no heap entry")  # fmt: skip


def require(ok: bool, invariant: str, detail: str) -> None:
    """Raise IntegrityError naming `invariant` unless `ok`."""
    if not ok:
        raise IntegrityError(f"{invariant}: {detail}")
