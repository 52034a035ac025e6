"""A read-only walk of the radix tree for one prompt: how far it matches, what the tree holds
right after, and whether another namespace of the same tenant or an evicted edge had more.

Other namespaces are not walked one by one: the caller names the few of the same tenant that
sent a prompt like this one (salts.py), and each is peeked (O(depth) each). Evicted edges come
from the tree's own record (cache/turns.py), in the prompt's namespace only.

Run `probe_tree` where the tree is owned (the engine thread, through `AsyncEngine.call`): it
reads nodes but changes nothing (no split, no LRU touch, no statistics), so asking for a report
never changes what the cache does. The text analysis of the result runs elsewhere (explain.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from radixlm.cache.radix_tree import RadixTree
from radixlm.cache.tree_node import TOKEN_BYTES, Namespace, TreeNode
from radixlm.cache.turns import EvictedRun

# Tokens of the tree's continuation kept for the comparison: enough for the text around the
# divergence and for a few reordered JSON objects, bounded so a probe stays cheap.
MAX_CONTINUATION = 2048


class TreeProbe(NamedTuple):
    cached_len: int  # prompt tokens the engine reuses (its lookup key is all but the last)
    continuation: tuple[int, ...]  # what the tree holds right after: the most recent branch
    other_namespace_len: int  # the longest match of the lookup key in another of its namespaces
    evicted: EvictedRun | None  # evicted edges of its namespace it follows from cached_len on


def probe_tree(
    tree: RadixTree,
    prompt: list[int] | np.ndarray,
    namespace: Namespace,
    others: Iterable[Namespace] = (),
) -> TreeProbe:
    """Walk `prompt[:-1]` (the engine's lookup key: the last prompt token is always computed,
    its logits start the output) in `namespace`, and peek it in each of `others` (the
    namespaces of the same tenant `PromptIndex.others` names). Reads the tree only."""
    ids = np.asarray(prompt, dtype=np.int64)[:-1]
    cached_len, continuation = _walk(tree, ids, namespace)
    other = max((tree.peek(ids, ns) for ns in others if ns != namespace), default=0)
    evicted = tree.turns.evicted_run(ids, cached_len, namespace)
    return TreeProbe(cached_len, continuation, other, evicted)


def _walk(tree: RadixTree, ids: np.ndarray, namespace: Namespace) -> tuple[int, tuple[int, ...]]:
    """(matched tokens in whole pages, up to MAX_CONTINUATION tree tokens after the match)."""
    node = tree.roots().get(namespace)
    if node is None:
        return 0, ()
    buf, page_b = ids.tobytes(), tree.page_size * TOKEN_BYTES
    end = len(buf) // page_b * page_b
    pos = 0
    while pos < end:
        child = node.children.get(buf[pos : pos + page_b])
        if child is None:
            break
        if buf.startswith(child.key, pos):
            pos += len(child.key)
            node = child
            continue
        edge = np.frombuffer(child.key, dtype=np.int64)
        n = min(len(edge), (end - pos) // TOKEN_BYTES)
        eq = edge[:n] == ids[pos // TOKEN_BYTES : pos // TOKEN_BYTES + n]
        common = n if eq.all() else int(eq.argmin())
        common = common // tree.page_size * tree.page_size
        return (pos // TOKEN_BYTES) + common, _continue(edge[common:], child)
    return pos // TOKEN_BYTES, _continue(np.empty(0, dtype=np.int64), node)


def _continue(head: np.ndarray, node: TreeNode) -> tuple[int, ...]:
    """`head`, then the edges below `node`, always into the most recently used child."""
    parts, total = [head], len(head)
    while node.children and total < MAX_CONTINUATION:
        node = max(node.children.values(), key=lambda c: c.last_access)
        parts.append(node.tokens)
        total += len(node.value)
    return tuple(int(t) for t in np.concatenate(parts)[:MAX_CONTINUATION])
