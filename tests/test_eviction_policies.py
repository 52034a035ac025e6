"""Eviction policies: what each one keeps, turn inference (with ghosts of evicted turns), and
random operation sequences per policy against the brute-force reference: every evicted node
had the smallest priority among the unlocked leaves at that moment, no priority ever decreases,
and check_integrity() holds after every step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tree_machine
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, run_state_machine_as_test

from radixlm.cache import create_prefix_cache
from radixlm.cache.adaptive import AdaptivePolicy, LearnedOffsets
from radixlm.cache.eviction import GDSFPolicy, TurnCreditPolicy
from radixlm.cache.kv_pool import SlotAllocator
from radixlm.cache.policies import POLICIES
from radixlm.cache.prefix_cache import RadixCache
from radixlm.cache.radix_tree import RadixTree, TreeNode
from radixlm.config import CacheConfig

SYS = list(range(1000, 1016))  # a 16-token system prompt every conversation starts with


def ids(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def put(tree: RadixTree, tokens: list[int], namespace: str | None = None) -> TreeNode:
    """A request: match its tokens, then insert them (fresh slot ids), as the engine does."""
    tree.match(ids(tokens), namespace)
    base = 10_000 * (tree.stats().num_queries + 1)
    return tree.insert(ids(tokens), np.arange(base, base + len(tokens)), namespace).node


def conversation(seed: int, turns: int) -> list[int]:
    """The prompt of turn `turns` of conversation `seed`: each turn appends 20 tokens."""
    return SYS + [seed * 100 + i for i in range(20 * turns)]


def test_a_later_turn_is_one_deeper_and_a_shared_system_prompt_is_not_a_turn() -> None:
    tree = RadixTree()
    assert put(tree, conversation(1, 1)).turn == 1
    assert put(tree, conversation(1, 2)).turn == 2
    assert put(tree, conversation(1, 3)).turn == 3
    assert put(tree, conversation(2, 1)).turn == 1  # only the system prompt is shared
    tree.check_integrity()


def test_an_evicted_conversation_is_recognised_when_it_comes_back() -> None:
    tree = RadixTree()
    put(tree, conversation(1, 1))
    put(tree, conversation(1, 2))
    put(tree, conversation(2, 1))
    tree.evict(tree.evictable_tokens - len(SYS))  # everything but the system prompt
    assert tree.num_tokens == len(SYS)
    assert put(tree, conversation(1, 3)).turn == 3  # the ghost of turn 2, not turn 1
    assert put(tree, conversation(3, 1)).turn == 1  # never seen: no ghost
    tree.check_integrity()


def test_turn_credit_keeps_a_returning_conversation_over_a_newer_first_turn() -> None:
    kept = {}
    for name in ("lru", "turn-credit"):
        tree = RadixTree(policy=name)
        if isinstance(tree.policy, TurnCreditPolicy):
            tree.policy.turnover = 100.0  # as if measured: an unpromoted node lives 100 ticks
        put(tree, conversation(1, 1))
        second = put(tree, conversation(1, 2))
        newer = put(tree, conversation(2, 1))
        tree.evict(20)
        kept[name] = (second.depth > 0, newer.depth > 0)
        tree.check_integrity()
    assert kept == {"lru": (False, True), "turn-credit": (True, False)}


def test_gdsf_evicts_the_cheaper_shallow_span_before_an_older_deep_one() -> None:
    tree = RadixTree(policy="gdsf")
    deep = put(tree, list(range(4000)))  # the mean position of its span is 2000: costlier
    shallow = put(tree, list(range(5000, 5040)))
    policy = tree.policy
    assert isinstance(policy, GDSFPolicy)
    assert policy.priority(shallow) < policy.priority(deep)
    tree.evict(1)
    assert shallow.depth == -1 and deep.depth == 4000
    assert policy.clock == shallow.priority  # the GDSF clock is the last evicted priority
    tree.check_integrity()


def test_the_policy_is_chosen_by_name_in_the_cache_config() -> None:
    cache = create_prefix_cache(CacheConfig(eviction="gdsf"), SlotAllocator(64))
    assert isinstance(cache, RadixCache) and cache.tree.policy.name == "gdsf"
    with pytest.raises(ValueError, match="eviction must be"):
        CacheConfig(eviction="lfu")  # type: ignore[arg-type]  # the bad value under test
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixTree(policy="mru")


# -- random operation sequences per policy against the brute-force reference ------------------


def unlocked_leaves(tree: RadixTree) -> list[TreeNode]:
    """Brute force: every unlocked leaf, found by walking the whole tree."""
    found, stack = [], list(tree.roots().values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None and not node.children and node.lock_ref == 0:
            found.append(node)
    return found


def make_machine(policy_name: str, page_size: int) -> type[RuleBasedStateMachine]:
    """The shared tree machine under `policy_name`: every evicted node has the smallest priority
    among the unlocked leaves when it goes, and no node's priority ever decreases."""
    tokens = st.lists(st.integers(0, 2), max_size=13)

    # a base class built per parameter (mypy takes no call as a base)
    class PolicyVersusReference(tree_machine(page_size, tokens, policy_name)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.tree.eviction_listener = self.check_popped_is_minimal
            self.seen: dict[int, tuple[TreeNode, list[int]]] = {}  # id -> (node, priorities)

        def check_popped_is_minimal(self, node: TreeNode) -> None:
            priority = self.tree.policy.priority
            others = unlocked_leaves(self.tree)  # still attached: `node` is among them
            assert node in others
            assert priority(node) == min(priority(n) for n in others)

        @invariant()
        def never_lowers_a_priority(self) -> None:
            experts = getattr(self.tree.policy, "experts", (self.tree.policy,))  # each order
            alive = {}
            stack = list(self.tree.roots().values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                old = self.seen.get(id(node))
                now = [e.priority(node) for e in experts]
                if old is not None and old[0] is node:
                    assert all(a >= b for a, b in zip(now, old[1])), "a priority decreased"
                alive[id(node)] = (node, now)
            self.seen = alive

    return PolicyVersusReference


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_policy_matches_the_reference(policy_name: str, page_size: int) -> None:
    machine = make_machine(policy_name, page_size)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=40, deadline=None)
    )


def test_adaptive_matches_the_reference_while_its_offsets_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adaptive policy keeps both of its heaps exact and no priority decreasing even when
    it relearns its offsets every few evictions and its weights at every return."""
    monkeypatch.setitem(POLICIES, "adaptive", lambda: AdaptivePolicy(epoch=2, window=1e9))
    machine = make_machine("adaptive", 1)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=40, deadline=None)
    )


def turns_out_of_ram(tree: RadixTree, seeds: range, turn: int) -> None:
    """Turn `turn` of conversations `seeds` (no shared prefix: ghosts tell them apart), then
    everything leaves the tree; the next turn of each finds only its ghost."""
    for seed in seeds:
        put(tree, [seed * 1000 + i for i in range(20 * turn)])
    tree.evict(tree.evictable_tokens)


def test_learned_offsets_keep_the_levels_that_come_back_and_lets_the_other_go_sooner() -> None:
    policy = LearnedOffsets(epoch=16, window=1e9)
    tree = RadixTree(policy=policy)
    assert policy.offsets == [0.0] * 9  # it starts as LRU
    for round_ in range(12):
        seeds = range(round_ * 10, round_ * 10 + 10)
        for turn in (1, 2, 3):  # turns 1 and 2 always come back; turn 3 never does
            turns_out_of_ram(tree, seeds, turn)
    first, second, third = policy.offsets[:3]  # levels 0, 1, 2: turns 1, 2, 3
    assert first > 0 and second > 0 and third < 0
    assert abs(first - second) < 0.25 * first  # alike return rates, alike offsets
    tree.check_integrity()


def test_learned_offsets_stay_lru_when_nothing_comes_back() -> None:
    policy = LearnedOffsets(epoch=16, window=1e9)
    tree = RadixTree(policy=policy)
    for round_ in range(12):
        turns_out_of_ram(tree, range(round_ * 10, round_ * 10 + 10), 1)
    assert policy.offsets == [0.0] * 9


@pytest.mark.parametrize("again", ["a", "b"])
def test_an_eviction_comes_back_only_in_its_own_namespace(again: str) -> None:
    """A new leaf that begins like an edge evicted in its own namespace is a return (the expert
    that evicted it loses weight); one in another namespace is not (the weights stay even)."""
    policy = AdaptivePolicy(window=1e9)
    tree = RadixTree(policy=policy)
    prompts = [[seed * 1000 + i for i in range(20)] for seed in range(10)]
    for prompt in prompts:
        put(tree, prompt, "a")
    tree.evict(tree.evictable_tokens)
    for prompt in prompts:
        put(tree, prompt, again)
    assert (policy.weights == [0.5, 0.5]) == (again == "b")
    tree.check_integrity()


def test_adaptive_follows_the_expert_whose_evictions_come_back_less() -> None:
    policy = AdaptivePolicy()
    for _ in range(100):
        policy._regret(1)  # the learned offsets' evictions keep coming back: follow LRU
    assert policy.weights == pytest.approx([1 - policy.floor, policy.floor])  # never all
    assert sum(policy.choose() == 0 for _ in range(1000)) > 950
    for _ in range(100):
        policy._regret(0)
    assert policy.weights[1] > 0.9
