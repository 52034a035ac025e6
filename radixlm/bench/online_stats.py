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
        **percentiles("ttft", ttft),
        **percentiles("itl", itl),
    }
    if cache is not None:
        summary["leaked_slots"] = int(cache.get("num_in_flight", 0))
        summary["accounting_ok"] = bool(cache.get("accounting_ok", False))
        summary["server_idle"] = bool(cache.get("idle", False))
    return summary


def percentiles(name: str, seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {f"{name}_p50_ms": float("nan"), f"{name}_p99_ms": float("nan")}
    ms = np.asarray(seconds) * 1000.0
    return {
        f"{name}_p50_ms": float(np.percentile(ms, 50)),
        f"{name}_p99_ms": float(np.percentile(ms, 99)),
        f"{name}_mean_ms": float(ms.mean()),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a few aligned lines for the terminal."""
    lines = [
        f"requests      {s['num_requests']} ({s['num_ok']} ok, {s['num_disconnected']} hung up "
        f"on purpose, {s['num_errors']} errors, {s['num_5xx']} 5xx)",
        f"duration      {s['duration_s']:.2f} s",
        f"throughput    {s['output_tok_s']:.1f} output tok/s, {s['request_s']:.2f} req/s",
        f"TTFT          p50 {s['ttft_p50_ms']:.1f} ms   p99 {s['ttft_p99_ms']:.1f} ms",
        f"ITL           p50 {s['itl_p50_ms']:.1f} ms   p99 {s['itl_p99_ms']:.1f} ms",
    ]
    if "followup_ttft_p50_ms" in s:
        lines.append(
            f"TTFT turns    first p50 {s['root_ttft_p50_ms']:.1f} ms, follow-up p50 "
            f"{s['followup_ttft_p50_ms']:.1f} ms   p99 {s['followup_ttft_p99_ms']:.1f} ms"
        )
    lines += [
        f"cached        {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens of completed "
        f"requests ({s['hit_rate']:.1%})",
    ]
    if s.get("server_prefill_tokens") is not None:
        lines.append(
            f"prefill       {s['server_prefill_tokens']} tokens computed by the server, "
            f"{s['ideal_prefill_tokens']} for an ideal cache"
        )
    if s.get("errors_by_status"):
        lines.append(f"errors        {s['errors_by_status']} {s['first_errors']}")
    if s.get("leaked_slots") is not None:
        lines.append(
            f"server slots  {s['leaked_slots']} in flight after the run, accounting "
            f"{'ok' if s['accounting_ok'] else 'BROKEN'} (free + tree + in flight == capacity)"
        )
    return "\n".join(lines)
