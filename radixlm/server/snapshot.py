"""A consistent picture of the engine, taken in the engine thread between two steps.

The prefix cache and the scheduler are not thread-safe, so the server never reads them from the
event loop: `/v1/cache` and `/metrics` run `take_snapshot` through `AsyncEngine.call` and work
from the copy. The slot accounting (`free + tree + in_flight == capacity`) is reported as read,
never recomputed from three separately taken counts; with an L2 tier, `l2` holds its counters.

`/metrics` goes through a `SnapshotCache`: scrapes that arrive together share one engine round
trip, and a snapshot younger than the TTL is served again, so a flood of scrapes costs the engine
thread at most one command per TTL instead of one per scrape (a stream's next token waits for
every command queued before it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from radixlm.cache.l2.cache import TieredRadixCache
from radixlm.engine.engine import Engine


@dataclass(frozen=True)
class EngineSnapshot:
    capacity: int  # KV slots in the pool
    num_free: int
    num_tree_tokens: int  # slots owned by the radix tree
    num_evictable: int  # of those, in unlocked nodes
    num_protected: int  # of those, locked by running requests
    num_in_flight: int  # slots owned by running requests, not yet in the tree
    num_waiting: int
    num_running: int
    num_unfinished: int
    engine_stats: dict[str, int]
    cache_stats: dict[str, Any]
    l2: dict[str, Any] | None = None  # the L2 tier's counters (TieredRadixCache.l2_stats)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def accounting_ok(self) -> bool:
        return self.num_free + self.num_tree_tokens + self.num_in_flight == self.capacity

    @property
    def idle(self) -> bool:
        """No request holds a slot: the state a finished or aborted workload must return to."""
        return self.num_unfinished == 0 and self.num_in_flight == 0 and self.accounting_ok

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["num_used"] = self.num_used
        out["accounting_ok"] = self.accounting_ok
        out["idle"] = self.idle
        return out


class SnapshotCache:
    """The latest snapshot, reused while younger than `ttl_s`; one refresh at a time."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._snapshot: EngineSnapshot | None = None
        self._taken = 0.0
        self._lock = asyncio.Lock()

    async def get(self, take: Callable[[], Awaitable[EngineSnapshot]]) -> EngineSnapshot:
        """A snapshot at most ttl_s old; `take` (an engine round trip) runs only when none is.
        Waiters on the lock find the snapshot their predecessor took."""
        async with self._lock:
            if self._snapshot is None or time.monotonic() - self._taken > self.ttl_s:
                self._snapshot = await take()
                self._taken = time.monotonic()
            return self._snapshot


def take_snapshot(engine: Engine) -> EngineSnapshot:
    """Read the engine's counters. Run it in the engine thread (`AsyncEngine.call`)."""
    cache = engine.cache
    return EngineSnapshot(
        capacity=int(cache.capacity),
        num_free=int(cache.num_free),
        num_tree_tokens=int(cache.num_tree_tokens),
        num_evictable=int(cache.num_evictable),
        num_protected=int(cache.num_protected),
        num_in_flight=int(cache.num_in_flight),
        num_waiting=engine.scheduler.num_waiting,
        num_running=engine.scheduler.num_running,
        num_unfinished=engine.num_unfinished,
        engine_stats=dataclasses.asdict(engine.stats),
        cache_stats=_jsonable(cache.stats()),
        l2=cache.l2_stats() if isinstance(cache, TieredRadixCache) else None,
    )


def flush_cache(engine: Engine) -> int:
    """Evict every unlocked node; the number of tokens evicted. Run it in the engine thread."""
    return int(engine.cache.flush())


def _jsonable(stats: Any) -> dict[str, Any]:
    """Cache statistics (a NamedTuple, a dataclass or a mapping) as a plain JSON dict."""
    if hasattr(stats, "_asdict"):
        items = stats._asdict()
    elif dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        items = dataclasses.asdict(stats)
    else:
        items = dict(stats)
    return {
        k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
        for k, v in items.items()
    }
