"""The recent misses, in a bounded ring per tenant, grouped by reason and by prompt segment.

`GET /v1/cache/report` serves `MissRings.summary(tenant)`: for each reason and each segment kind
("system.content", "tools", ...) how many explained requests of that tenant missed there and the
tokens it cost (`lost_tokens`: the prefill a perfect client would have saved). Only requests
that asked for a report (`return_cache_report`) are in it: explaining costs nothing for the
others.

Rule: a report carries its prompt's text, so a tenant's misses go to that tenant's ring only, and
a summary is built from one ring (or, for the operator, from all of them). The number of rings is
bounded too (tenants named by a header or a salt are not): past `max_tenants`, the ring used
least recently is dropped whole.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from typing import Any

from radixlm.observatory.explain import CacheReport

RECENT = 50  # misses listed one by one in a summary, newest first
RING_CAPACITY = 256  # misses kept per tenant
MAX_TENANTS = 256  # rings kept; the least recently used one goes first


class MissLog:
    """The last `capacity` misses of one tenant (hits are only counted). Not locked: its
    owner (`MissRings`) is."""

    def __init__(self, capacity: int = RING_CAPACITY) -> None:
        self.misses: deque[tuple[float, CacheReport]] = deque(maxlen=capacity)
        self.num_hits = 0

    def add(self, report: CacheReport) -> None:
        if report.reason == "hit":
            self.num_hits += 1
        else:
            self.misses.append((time.time(), report))


class MissRings:
    """One MissLog per tenant, at most `max_tenants` of them. Thread-safe."""

    def __init__(self, capacity: int = RING_CAPACITY, max_tenants: int = MAX_TENANTS) -> None:
        self.capacity = capacity
        self.max_tenants = max_tenants
        self._rings: OrderedDict[Hashable, MissLog] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, tenant: Hashable, report: CacheReport) -> None:
        with self._lock:
            ring = self._rings.get(tenant)
            if ring is None:
                ring = self._rings[tenant] = MissLog(self.capacity)
                if len(self._rings) > self.max_tenants:
                    self._rings.popitem(last=False)
            self._rings.move_to_end(tenant)
            ring.add(report)

    def summary(self, tenant: Hashable) -> dict[str, Any]:
        """The summary of `tenant`'s ring (empty for a tenant with none)."""
        with self._lock:
            ring = self._rings.get(tenant)
            rings = [] if ring is None else [ring]
            return _summary(_take(rings), sum(r.num_hits for r in rings))

    def summary_all(self) -> dict[str, Any]:
        """The operator's summary: every tenant's ring together."""
        with self._lock:
            rings = list(self._rings.values())
            return _summary(_take(rings), sum(r.num_hits for r in rings))

    def __len__(self) -> int:
        return len(self._rings)


def _take(rings: Iterable[MissLog]) -> list[tuple[float, CacheReport]]:
    """The misses of `rings`, oldest first (copied under the lock)."""
    return sorted((m for ring in rings for m in ring.misses), key=lambda m: m[0])


def _summary(misses: list[tuple[float, CacheReport]], num_hits: int) -> dict[str, Any]:
    by_reason: dict[str, dict[str, int]] = {}
    by_segment: dict[str, dict[str, int]] = {}
    for _, report in misses:
        _count(by_reason, report.reason, report.lost_tokens)
        _count(by_segment, report.segment_kind or "unknown", report.lost_tokens)
    recent = [{"at": at, **report.to_dict()} for at, report in reversed(misses[-RECENT:])]
    return {
        "num_misses": len(misses),
        "num_hits": num_hits,
        "lost_tokens": sum(r.lost_tokens for _, r in misses),
        "by_reason": by_reason,
        "by_segment": by_segment,
        "recent": recent,
    }


def _count(groups: dict[str, dict[str, int]], key: str, lost: int) -> None:
    group = groups.setdefault(key, {"count": 0, "lost_tokens": 0})
    group["count"] += 1
    group["lost_tokens"] += lost
