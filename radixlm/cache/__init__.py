"""The KV cache: who owns every KV slot, and which prefix a request reuses.

`create_prefix_cache` builds the cache a config names: a RadixCache over a radix tree
(radix_tree.py), with a disk tier (l2/) when `l2_dir` is set, or NoCache (the ablation). The
modules import one way: tree_node <- eviction, turns, integrity <- radix_tree <- prefix_cache
<- no_cache, l2/ (tests/test_cache_imports.py checks that no import cycle is left).
"""

from __future__ import annotations

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2.cache import open_tiered_cache
from radixlm.cache.no_cache import NoCache
from radixlm.cache.prefix_cache import PrefixCache, RadixCache, SlotPool
from radixlm.cache.radix_tree import RadixTree
from radixlm.config import CacheConfig

__all__ = ["create_prefix_cache"]


def create_prefix_cache(config: CacheConfig, pool: SlotPool) -> PrefixCache:
    """The cache named by `config.cache` ("radix" or "none") over `pool`; with `l2_dir`, the
    radix cache gets a disk tier (l2/cache.py), or none if its file cannot be made (logged)."""
    if config.cache != "radix":
        return NoCache(pool)
    if config.l2_dir is not None:
        if not isinstance(pool, KVPool):
            raise ValueError("an L2 tier needs the KV pool itself, not a bare slot allocator")
        tiered = open_tiered_cache(config, pool)
        if tiered is not None:
            return tiered
    return RadixCache(pool, RadixTree(page_size=config.page_size, policy=config.eviction))
