"""The tree's draft index reads continuations from the radix tree and never changes it.

- A run of tokens that recurs in a remembered path finds the tokens after it, read from the
  nodes' edges, across splits, and below the remembered node into the most recent child.
- Lookups and reads change nothing in the tree: no split, no LRU touch, no statistics.
- Namespaces: a lookup sees only the caller's namespace.
- After eviction a position is read from the ancestors still in the tree, or not at all.
- The index holds at most its bound of positions, the oldest requests' going first.
"""

from __future__ import annotations

import numpy as np

from radixlm.cache.drafts import NGRAM, TreeDrafts, TreeSpot, read_path
from radixlm.cache.radix_tree import RadixTree
from radixlm.cache.tree_node import TreeNode


def arr(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


_SLOTS = iter(range(1 << 30))


def insert(tree: RadixTree, ids: list[int], ns: str | None = None) -> TreeNode:
    """Insert `ids` with fresh slots; the node ending them."""
    slots = arr([next(_SLOTS) for _ in ids])
    return tree.insert(arr(ids), slots, ns).node


def snapshot(tree: RadixTree) -> tuple[object, ...]:
    nodes = []
    stack = list(tree.roots().values())
    while stack:
        node = stack.pop()
        nodes.append((node.key, node.depth, node.last_access, node.hits, len(node.children)))
        stack.extend(node.children.values())
    return (tree.stats(), tree.version, sorted(nodes, key=repr))


def test_a_recurring_run_finds_what_follows_it() -> None:
    tree = RadixTree()
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    node = insert(tree, seq)
    drafts = TreeDrafts()
    drafts.remember(None, node, arr(seq), 0)
    spots = drafts.lookup(None, [1, 2, 7, 8, 9])
    assert spots == [TreeSpot(node, 5)]  # right after the run: seq[5] = 10
    assert read_path(spots[0], 3) == (10, 11, 12)
    assert read_path(spots[0], 10) == (10, 11, 12, 13)
    assert drafts.lookup(None, [7, 8, 4]) == []


def test_reads_cross_splits_and_go_below_into_the_latest_child() -> None:
    tree = RadixTree()
    seq = list(range(20, 40))
    node = insert(tree, seq)
    drafts = TreeDrafts()
    drafts.remember(None, node, arr(seq), 0)
    tree.match(arr(seq[:5]))  # splits the edge after 5 tokens
    tree.match(arr(seq[:12]))  # and after 12
    spot = drafts.lookup(None, seq[2:5])[0]
    assert read_path(spot, 10) == tuple(seq[5:15])
    # below the remembered node: two continuations, the most recently used is read
    insert(tree, [*seq, 1, 2, 3])
    insert(tree, [*seq, 7, 8, 9])
    end = drafts.lookup(None, seq[-NGRAM:])[0]
    assert read_path(end, 3) == (7, 8, 9)


def test_lookups_and_reads_change_nothing_in_the_tree() -> None:
    tree = RadixTree()
    a = insert(tree, list(range(10, 30)))
    insert(tree, [*range(10, 20), 99, 98, 97])
    drafts = TreeDrafts()
    drafts.remember(None, a, arr(list(range(10, 30))), 0)
    before = snapshot(tree)
    for spot in drafts.lookup(None, [13, 14, 15]):
        read_path(spot, 30)
    drafts.lookup("other", [13, 14, 15])
    assert snapshot(tree) == before
    tree.check_integrity()


def test_a_namespace_sees_only_its_own_paths() -> None:
    tree = RadixTree()
    seq = [1, 2, 3, 4, 5, 6]
    drafts = TreeDrafts()
    drafts.remember("alice", insert(tree, seq, "alice"), arr(seq), 0)
    assert drafts.lookup("bob", [1, 2, 3]) == []
    assert drafts.lookup(None, [1, 2, 3]) == []
    assert read_path(drafts.lookup("alice", [1, 2, 3])[0], 3) == (4, 5, 6)


def test_evicted_positions_read_from_what_the_tree_kept() -> None:
    tree = RadixTree()
    trunk = list(range(50, 60))
    leaf = insert(tree, [*trunk, 1, 2, 3, 4])
    drafts = TreeDrafts()
    drafts.remember(None, leaf, arr([*trunk, 1, 2, 3, 4]), 0)
    insert(tree, [*trunk, 8, 9])  # the trunk becomes its own node
    tree.lock(tree.match(arr(trunk)).node)  # keep the trunk, evict the leaves
    tree.evict(100)
    assert leaf.depth == -1
    early = drafts.lookup(None, trunk[3:6])[0]
    assert read_path(early, 4) == tuple(trunk[6:10])  # the trunk still holds it
    late = drafts.lookup(None, [*trunk, 1, 2][-NGRAM:])[0]
    assert read_path(late, 2) == ()  # the leaf that held it is gone


def test_the_index_is_bounded_and_forgets_the_oldest_first() -> None:
    tree = RadixTree()
    drafts = TreeDrafts(max_positions=30)
    old = list(range(100, 120))
    new = list(range(200, 220))
    drafts.remember(None, insert(tree, old), arr(old), 0)
    drafts.remember(None, insert(tree, new), arr(new), 0)
    assert drafts.num_positions <= 30
    assert drafts.lookup(None, old[:3]) == []
    assert drafts.lookup(None, new[:3]) != []


def test_only_the_positions_a_request_added_are_indexed() -> None:
    tree = RadixTree()
    seq = list(range(300, 320))
    drafts = TreeDrafts()
    drafts.remember(None, insert(tree, seq), arr(seq), start=10)
    assert drafts.lookup(None, seq[2:5]) == []  # before `start`: another request's to index
    assert drafts.num_positions == len(seq) - 10 + 1
    assert read_path(drafts.lookup(None, seq[8:11])[0], 2) == (311, 312)
