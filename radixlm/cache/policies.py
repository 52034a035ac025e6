"""Eviction policies by name: what `CacheConfig.eviction` and `--eviction` choose from."""

from __future__ import annotations

from collections.abc import Callable

from radixlm.cache.adaptive import AdaptivePolicy
from radixlm.cache.eviction import EvictionPolicy, GDSFPolicy, LRUPolicy, TurnCreditPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "turn-credit": TurnCreditPolicy,
    "gdsf": GDSFPolicy,
    "adaptive": AdaptivePolicy,  # learns online which order to follow (cache/adaptive.py)
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from its name (see POLICIES) or the instance itself."""
    if not isinstance(policy, str):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {sorted(POLICIES)}")
    return POLICIES[policy]()
