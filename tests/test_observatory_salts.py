"""The salt check's index: another namespace that sent a prompt like this one is found by prefix
hashes, and a report peeks only that namespace, however many namespaces the tree holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from radixlm.cache.radix_tree import RadixTree
from radixlm.observatory.probe import probe_tree
from radixlm.observatory.salts import MAX_OTHERS, NAMESPACES_PER_KEY, PromptIndex


def ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 30000, n)]


def test_finds_the_namespace_sharing_the_longest_prefix() -> None:
    index = PromptIndex()
    shared = ids(0, 100)
    index.record(shared + ids(1, 50), "tenant-a")  # shares 100 tokens with the asked prompt
    index.record(shared[:40] + ids(2, 50), "tenant-b")  # shares 40
    index.record(ids(3, 200), "tenant-c")  # nothing
    asked = shared + ids(4, 30)
    assert index.others(asked, "tenant-d") == ["tenant-a"]
    assert index.others(asked, "tenant-a") == ["tenant-b"]  # its own namespace never counts
    assert index.others(ids(5, 300), "tenant-d") == []


def test_the_same_prompt_under_other_salts_most_recent_first() -> None:
    index = PromptIndex()
    prompt = ids(0, 12)  # shorter than the first boundary: the whole key still matches
    for tenant in ("a", "b", "c", "d", "e", "f"):
        index.record(prompt, tenant)
    index.record(prompt, "c")
    others = index.others(prompt, "b")
    assert others[0] == "c" and "b" not in others
    assert len(others) <= min(MAX_OTHERS, NAMESPACES_PER_KEY)


def test_index_is_bounded() -> None:
    index = PromptIndex(capacity=100)
    for seed in range(200):
        index.record(ids(seed, 500), f"tenant-{seed}")
    assert len(index) == 100
    assert index.others(ids(199, 500), None) == ["tenant-199"]  # the newest stay
    assert index.others(ids(0, 500), None) == []  # the oldest went


def test_probe_peeks_only_the_named_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 namespaces in the tree: the report of one prompt peeks one of them."""
    tree, index = RadixTree(), PromptIndex()
    header = ids(7, 8)  # every namespace starts with the same template header
    for n in range(2000):
        prompt = header + ids(10 + n, 60)
        tree.insert(prompt, np.arange(len(prompt)), f"tenant-{n}")
        index.record(prompt, f"tenant-{n}")
    asked = header + ids(10 + 1234, 60)
    peeked: list[object] = []
    peek = tree.peek

    def peek_noted(t: np.ndarray, ns: str | None) -> Any:
        peeked.append(ns)
        return peek(t, ns)

    monkeypatch.setattr(tree, "peek", peek_noted)
    probe = probe_tree(tree, asked, "tenant-new", others=index.others(asked, "tenant-new"))
    assert peeked == ["tenant-1234"]
    assert probe.cached_len == 0 and probe.other_namespace_len == len(asked) - 1
