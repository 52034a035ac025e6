"""The radix tree as a bounded JSON picture for the /cache page, built in the engine thread.

A tree can hold 100k nodes; the page shows at most `max_nodes`. The walk is breadth first and
bounded: under each node the `max_children` children with the biggest look (edge tokens, plus
their own fan-out) are shown and the rest become one aggregate node ("37 more branches, 2,104
tokens"); once `max_nodes` are taken every further subtree is an aggregate under its parent. So
the engine thread pays O(max_nodes * max_children), never a walk of the whole tree.

Token text is not here: with the server's `cache_page_text` on, each node carries its first
token ids and the route decodes them outside the engine thread (prompts are private).

A tenant's picture (`owns` given) holds its own namespaces only: other namespaces' roots, sizes
and totals are not in it at all, and its counts are the picture's own sums. `last_access` is a
node's rank in the order of last use among the nodes shown, never the tree's clock, which ticks
with every tenant's requests.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from radixlm.cache.radix_tree import RadixTree
from radixlm.cache.tree_node import Namespace, TreeNode

HEAD_TOKENS = 16  # token ids per node sent for its label, when text is on
NEXT_EVICTED = 8  # least recently used evictable leaves shown as "next to go"


def tree_picture(
    tree: RadixTree,
    max_nodes: int = 400,
    max_children: int = 8,
    with_tokens: bool = False,
    owns: Callable[[Namespace], bool] | None = None,
) -> dict[str, Any]:
    """{"num_nodes", "num_tokens", "evictable_tokens", "protected_tokens", "nodes": [...]}; a
    node: id, parent (None for a namespace root), tokens (its edge), depth, lock_ref, leaf,
    evictable, last_access (its rank in the order of use), hits (when the tree counts them),
    next_evicted, and for an aggregate: aggregate=True, count. With `owns`, only the
    namespaces it accepts, and the counts are the picture's. Reads the tree only."""
    nodes: list[dict[str, Any]] = []
    queue: deque[tuple[TreeNode, int | None]] = deque()
    for namespace, root in sorted(tree.roots().items(), key=lambda kv: str(kv[0])):
        if owns is None or owns(namespace):
            queue.append((root, None))
    leaves: list[tuple[int, int]] = []  # (last_access, index in nodes) of evictable leaves
    while queue:
        node, parent = queue.popleft()
        index = len(nodes)
        nodes.append(_describe(node, index, parent, with_tokens))
        if nodes[-1]["evictable"]:
            leaves.append((node.last_access, index))
        room = max(0, min(max_children, max_nodes - len(nodes) - len(queue)))
        shown = heapq.nlargest(room, node.children.values(), key=_look)
        for child in shown:
            queue.append((child, index))
        if len(node.children) > len(shown):
            nodes.append(_aggregate(node, shown, len(nodes), index))
    for _, index in sorted(leaves)[:NEXT_EVICTED]:
        nodes[index]["next_evicted"] = True
    _rank_uses(nodes)
    if owns is not None:
        return {**_sums(nodes), "nodes": nodes}
    return {
        "num_nodes": tree.num_nodes,
        "num_tokens": tree.num_tokens,
        "evictable_tokens": tree.evictable_tokens,
        "protected_tokens": tree.protected_tokens,
        "nodes": nodes,
    }


def _rank_uses(nodes: list[dict[str, Any]]) -> None:
    """Replace each node's last_access (the tree's clock) by its rank among the picture's."""
    times = sorted({n["last_access"] for n in nodes if "last_access" in n})
    rank = {t: i for i, t in enumerate(times)}
    for n in nodes:
        if "last_access" in n:
            n["last_access"] = rank[n["last_access"]]


def _sums(nodes: list[dict[str, Any]]) -> dict[str, int]:
    """The counts of a picture from its own nodes (a root is no node; an aggregate counts its
    children, and their edges' tokens)."""
    num_nodes = num_tokens = protected = 0
    for n in nodes:
        if n.get("aggregate"):
            num_nodes += n["count"]
        elif n["parent"] is not None:
            num_nodes += 1
        num_tokens += n["tokens"]
        protected += n["tokens"] if n["lock_ref"] > 0 else 0
    return {
        "num_nodes": num_nodes,
        "num_tokens": num_tokens,
        "evictable_tokens": num_tokens - protected,
        "protected_tokens": protected,
    }


def _look(node: TreeNode) -> int:
    """How much a child deserves a place: its edge, and its fan-out as a hint of what hangs
    below (subtree sizes would need the walk of the whole tree this avoids)."""
    return len(node.value) + 16 * len(node.children)


def _describe(node: TreeNode, index: int, parent: int | None, with_tokens: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": index,
        "parent": parent,
        "tokens": len(node.value),
        "depth": max(node.depth, 0),
        "lock_ref": node.lock_ref,
        "leaf": not node.children,
        "evictable": parent is not None and not node.children and node.lock_ref == 0,
        "last_access": node.last_access,
        "next_evicted": False,
    }
    hits = getattr(node, "hits", None)  # counted by trees that keep per-node hit counts
    if isinstance(hits, int):
        out["hits"] = hits
    if with_tokens:
        out["head"] = [int(t) for t in node.tokens[:HEAD_TOKENS]]
    return out


def _aggregate(node: TreeNode, shown: list[TreeNode], index: int, parent: int) -> dict[str, Any]:
    """One node standing for the children of `node` not in `shown`."""
    children = node.children.values()
    return {
        "id": index,
        "parent": parent,
        "aggregate": True,
        "count": len(children) - len(shown),
        # their edges only: the tokens deeper down are not walked
        "tokens": sum(len(c.value) for c in children) - sum(len(c.value) for c in shown),
        "lock_ref": sum(c.lock_ref for c in children) - sum(c.lock_ref for c in shown),
        "leaf": True,
        "evictable": False,
        "next_evicted": False,
    }
