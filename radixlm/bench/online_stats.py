"""The figures of an online benchmark run, from the client's records.

TTFT counts every request that received a first token (those that hung up later included);
inter-token latency pools the gaps of every stream; throughput divides the output tokens received
by the wall time of the whole run. A request that hung up on purpose is not an error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixlm.bench.online_client import RequestRecord


def summarize(
    records: Sequence[RequestRecord], duration_s: float, cache: dict[str, Any] | None
) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    itl = [gap for r in records for gap in r.itl_s]
    errors = [r for r in records if not r.ok and not r.disconnected]
    completed = [r for r in records if r.ok and not r.disconnected]
    prompt_tokens = sum(r.prompt_len for r in completed)
    cached = sum(r.cached_tokens or 0 for r in completed)
    output_tokens = sum(r.num_output_tokens for r in records)
    statuses = Counter(str(r.status) if r.status is not None else "connection" for r in errors)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_ok": len(completed),
        "num_disconnected": sum(r.disconnected for r in records),
        "num_errors": len(errors),
        "num_5xx": sum(1 for r in records if r.status is not None and r.status >= 500),
        "errors_by_status": dict(statuses),
        "first_errors": [r.error for r in errors[:3]],
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "request_s": len(records) / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        **_percentiles("ttft", ttft),
        **_percentiles("itl", itl),
    }
    if cache is not None:
        summary["leaked_slots"] = int(cache.get("num_in_flight", 0))
        summary["accounting_ok"] = bool(cache.get("accounting_ok", False))
        summary["server_idle"] = bool(cache.get("idle", False))
    return summary


def _percentiles(name: str, seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {f"{name}_p50_ms": float("nan"), f"{name}_p99_ms": float("nan")}
    ms = np.asarray(seconds) * 1000.0
    return {
        f"{name}_p50_ms": float(np.percentile(ms, 50)),
        f"{name}_p99_ms": float(np.percentile(ms, 99)),
        f"{name}_mean_ms": float(ms.mean()),
    }
