"""The radix tree: unit behaviour, and random operation sequences against a brute-force model
with check_integrity() after every step (page sizes 1 and 4, two namespaces)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import EvictionSnapshot, tree_machine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from tree_reference import Key

from radixlm.cache.integrity import IntegrityError
from radixlm.cache.radix_tree import RadixTree


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def slots_for(tokens: np.ndarray, base: int) -> np.ndarray:
    return np.arange(base, base + len(tokens), dtype=np.int64)


def test_match_on_an_empty_tree_returns_the_root() -> None:
    tree = RadixTree()
    m = tree.match(ids(1, 2, 3))
    assert m.length == 0 and m.slots.size == 0 and m.node.parent is None
    tree.check_integrity()


def test_insert_then_match_returns_the_slots() -> None:
    tree = RadixTree()
    assert tree.insert(ids(1, 2, 3, 4), ids(10, 11, 12, 13)).prefix_len == 0
    m = tree.match(ids(1, 2, 3, 4, 5))
    assert m.length == 4 and m.slots.tolist() == [10, 11, 12, 13]
    assert tree.insert(ids(1, 2, 3, 4, 5), ids(90, 91, 92, 93, 14)).prefix_len == 4
    assert tree.match(ids(1, 2, 3, 4, 5)).slots.tolist() == [10, 11, 12, 13, 14]
    tree.check_integrity()


def test_match_inside_an_edge_splits_it_and_the_old_node_keeps_the_lower_part() -> None:
    tree = RadixTree()
    leaf = tree.insert(ids(1, 2, 3, 4, 5), slots_for(ids(1, 2, 3, 4, 5), 0)).node
    tree.lock(leaf)
    m = tree.match(ids(1, 2, 9))
    assert m.length == 2 and m.slots.tolist() == [0, 1]
    assert m.node.depth == 2 and m.node is leaf.parent  # the new node is the upper part
    assert leaf.depth == 5 and leaf.tokens.tolist() == [3, 4, 5]  # same object, lower part
    assert m.node.lock_ref == 1  # inherited: the locked leaf below still pins it
    assert tree.stats().num_splits == 1
    tree.check_integrity()
    tree.unlock(leaf)
    tree.check_integrity()


def test_pages_match_and_insert_whole_pages_only() -> None:
    tree = RadixTree(page_size=4)
    r = tree.insert(ids(*range(10)), slots_for(ids(*range(10)), 100))
    assert r.node.depth == 8  # the partial third page is not inserted
    assert tree.match(ids(*range(7))).length == 4
    assert tree.match(ids(0, 1, 2, 3, 4, 5, 6, 99)).length == 4  # diverges inside page 2
    tree.check_integrity()


def test_namespaces_never_share() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3), ids(0, 1, 2), namespace="a")
    assert tree.match(ids(1, 2, 3)).length == 0
    assert tree.match(ids(1, 2, 3), namespace="b").length == 0
    assert tree.match(ids(1, 2, 3), namespace="a").length == 3
    assert tree.insert(ids(1, 2, 3), ids(5, 6, 7), namespace="b").prefix_len == 0
    tree.check_integrity()
    tree.flush()
    assert set(tree.roots()) == {None}  # emptied tenant roots are forgotten
    tree.check_integrity()


def test_lock_protects_the_path_and_unlock_below_zero_raises() -> None:
    tree = RadixTree()
    a = tree.insert(ids(1, 2, 3), ids(0, 1, 2)).node
    b = tree.insert(ids(1, 2, 4), ids(0, 1, 3)).node
    tree.lock(b)
    assert (tree.evictable_tokens, tree.protected_tokens) == (1, 3)
    assert tree.evict(100).num_tokens == 1  # only a's own token
    assert a.depth == -1 and b.depth == 3
    tree.check_integrity()
    with pytest.raises(ValueError, match="evicted"):
        tree.lock(a)
    tree.unlock(b)
    with pytest.raises(ValueError, match="holds no lock"):
        tree.unlock(b)
    tree.check_integrity()


def test_evict_takes_least_recently_used_leaves_and_then_their_parents() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3), ids(0, 1, 2))  # shared [1, 2] with leaves [3] and [4]
    tree.insert(ids(1, 2, 4), ids(0, 1, 3))
    tree.insert(ids(7, 8), ids(4, 5))
    tree.match(ids(1, 2, 3))  # [1, 2, 3] is now the most recent
    assert tree.evict(1).slots.tolist() == [3]  # leaf [4] is the oldest
    assert tree.evict(1).slots.tolist() == [4, 5]  # then [7, 8], whole
    assert sorted(tree.evict(3).slots.tolist()) == [0, 1, 2]  # [3], then its parent
    assert tree.num_tokens == 0 and tree.num_nodes == 0
    tree.check_integrity()


def test_evict_with_everything_locked_frees_nothing() -> None:
    tree = RadixTree()
    tree.lock(tree.insert(ids(1, 2), ids(0, 1)).node)
    result = tree.evict(5)
    assert result.num_tokens == 0 and result.slots.size == 0


def test_long_edges_and_path_helpers() -> None:
    tree = RadixTree()
    long = np.arange(200_000, dtype=np.int64)
    tree.insert(long, long + 1)
    query = long.copy()
    query[150_000] = -5
    m = tree.match(query)
    assert m.length == 150_000 and np.array_equal(m.slots, long[:150_000] + 1)
    assert tree.ends_path(m.node, long) and not tree.ends_path(m.node, query[::-1].copy())
    assert np.array_equal(tree.path_slots(m.node), m.slots)
    tree.check_integrity()


def test_check_integrity_names_the_broken_invariant() -> None:
    tree = RadixTree()
    node = tree.insert(ids(1, 2, 3), ids(0, 1, 2)).node
    tree.insert(ids(1, 2, 4), ids(0, 1, 3))
    tree.evictable_tokens += 1
    with pytest.raises(IntegrityError, match="evictable sum"):
        tree.check_integrity()
    tree.evictable_tokens -= 1
    node.own_locks = 1
    with pytest.raises(IntegrityError, match="lock counts"):
        tree.check_integrity()
    node.own_locks = 0
    tree.eviction_order().discard(node)
    with pytest.raises(IntegrityError, match="eviction order"):
        tree.check_integrity()


def test_stats_count_queries_hits_inserts_and_evictions() -> None:
    tree = RadixTree()
    tree.insert(ids(1, 2, 3), ids(0, 1, 2))
    tree.match(ids(1, 2, 9, 9))
    tree.evict(10)
    s = tree.stats()
    assert (s.num_queries, s.queried_tokens, s.hit_tokens) == (1, 4, 2)
    assert (s.inserted_tokens, s.evicted_tokens, s.num_nodes) == (3, 3, 0)


# -- random operation sequences against the brute-force reference -----------------------------

NUM_STEPS = {"steps": 0}  # checked operations, counted across the machines


def make_machine(page_size: int, vocab: int, max_len: int) -> type[RuleBasedStateMachine]:
    """Random match / peek / insert / lock / unlock / evict over a tiny vocabulary (prefixes
    collide and edges split constantly); after each step the tree must agree with the
    brute-force reference and pass check_integrity(), and evict must take least recently used
    leaves first."""
    tokens = st.lists(st.integers(0, vocab - 1), max_size=max_len)

    # a base class built per parameter (mypy takes no call as a base)
    class TreeVersusReference(tree_machine(page_size, tokens)):  # type: ignore[misc]
        @rule(tokens=tokens, namespace=st.sampled_from([None, "tenant"]))
        def peek(self, tokens: list[int], namespace: str | None) -> None:
            before = (self.tree.num_nodes, self.tree.stats())
            length = 0
            for key in self.ref._page_keys(tokens, namespace):  # the reference, untouched
                if key not in self.ref.slots:
                    break
                length = len(key[1])
            assert self.tree.peek(np.array(tokens, dtype=np.int64), namespace) == length
            assert (self.tree.num_nodes, self.tree.stats()) == before  # changes nothing

        def evicted(self, gone: list[Key], before: EvictionSnapshot) -> None:
            if gone:  # LRU: nothing evicted was touched after a leaf that stays
                newest_gone = max(before.access[key] for key in gone)
                stays = before.leaves - before.protected - set(gone)
                assert all(newest_gone <= self.ref.access[key] for key in stays)

        @invariant()
        def held_nodes_still_end_their_sequences(self) -> None:
            NUM_STEPS["steps"] += 1
            for namespace, seq, node in self.locks:
                assert node.depth == len(seq)
                assert self.tree.ends_path(node, np.array(seq, dtype=np.int64), namespace)

    return TreeVersusReference


@pytest.mark.parametrize(
    ("page_size", "vocab", "max_len"), [(1, 3, 13), (4, 2, 17)], ids=["page1", "page4"]
)
def test_tree_matches_the_reference(page_size: int, vocab: int, max_len: int) -> None:
    before = NUM_STEPS["steps"]
    machine = make_machine(page_size, vocab, max_len)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=150, stateful_step_count=50, deadline=None)
    )
    assert NUM_STEPS["steps"] - before >= 5_000  # 10,000+ checked operations over both
