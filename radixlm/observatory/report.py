"""The recent misses, in a bounded ring, grouped by reason and by prompt segment.

`GET /v1/cache/report` serves `MissLog.summary()`: for each reason and each segment kind
("system.content", "tools", ...) how many explained requests missed there and the tokens it
cost (`lost_tokens`: the prefill a perfect client would have saved). Only requests that asked
for a report (`return_cache_report`) are in it: explaining costs nothing for the others.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from radixlm.observatory.explain import CacheReport

RECENT = 50  # misses listed one by one in a summary, newest first


class MissLog:
    """The last `capacity` misses (hits are only counted). Thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        self._misses: deque[tuple[float, CacheReport]] = deque(maxlen=capacity)
        self._num_hits = 0
        self._lock = threading.Lock()

    def add(self, report: CacheReport) -> None:
        with self._lock:
            if report.reason == "hit":
                self._num_hits += 1
            else:
                self._misses.append((time.time(), report))

    def summary(self) -> dict[str, Any]:
        with self._lock:
            misses = list(self._misses)
            num_hits = self._num_hits
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
