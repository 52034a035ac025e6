"""The figures of an online benchmark run, from the client's records.

TTFT counts every request that received a first token (those that hung up later included);
inter-token latency pools the gaps of every stream; throughput divides the output tokens received
by the wall time of the whole run. A request that hung up on purpose is not an error.

With timelines (radixlm's `return_timeline`), each stage's median and p99 over the requests;
from a radixlm server's engine counters, the served efficiency: the share of the run's wall time
the engine spent in forward passes (and in steps at all).
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


def timeline_summary(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Per stage of the requests' timelines, p50 / p99 / mean in ms, and the same of their
    first_token_ms; None when no request brought one back."""
    timelines = [r.timeline for r in records if r.timeline is not None]
    if not timelines:
        return None
    stages: dict[str, dict[str, float]] = {}
    for stage in timelines[0]["stages_ms"]:
        values = [t["stages_ms"][stage] for t in timelines if t["stages_ms"][stage] is not None]
        if values:
            stages[stage] = _ms_percentiles(values)
    return {
        "num_requests": len(timelines),
        "first_token_ms": _ms_percentiles([t["first_token_ms"] for t in timelines]),
        "num_forwards_p50": float(np.median([t["num_forwards"] for t in timelines])),
        "stages_ms": stages,
    }


def served_efficiency(rows: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any] | None:
    """Forward and step seconds over the run's wall time, from the one server's engine
    counters (None without them, or for several replicas: each has its own)."""
    if len(rows) != 1 or rows[0].get("forward_s") is None or duration_s <= 0:
        return None
    row = rows[0]
    return {
        "forward_s": row["forward_s"],
        "step_s": row["step_s"],
        "served_efficiency": row["forward_s"] / duration_s,
        "step_share": row["step_s"] / duration_s,
    }


def merged_accounting(caches: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The accounting of every server that answered, as one /v1/cache-like dict."""
    answered = [c for c in caches.values() if c is not None]
    if not answered:
        return None
    return {
        "num_in_flight": sum(int(c.get("num_in_flight", 0)) for c in answered),
        "accounting_ok": all(c.get("accounting_ok", False) for c in answered),
        "idle": all(c.get("idle", False) for c in answered),
    }


def server_rows(
    before: dict[str, dict[str, Any] | None], after: dict[str, dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """Per server: the prefill it computed during the run, its accounting after it."""
    rows = []
    for url, cache in after.items():
        start = before.get(url)
        prefill = forward = step = None
        if cache is not None and start is not None:
            now, then = cache["engine_stats"], start["engine_stats"]
            prefill = now["prefill_tokens"] - then["prefill_tokens"]
            if "forward_s" in now and "forward_s" in then:  # a radixlm that counts them
                forward, step = now["forward_s"] - then["forward_s"], now["step_s"] - then["step_s"]
        rows.append(
            {
                "url": url,
                "answered": cache is not None,
                "prefill_tokens": prefill,
                "forward_s": forward,
                "step_s": step,
                "num_in_flight": None if cache is None else cache.get("num_in_flight"),
                "num_tree_tokens": None if cache is None else cache.get("num_tree_tokens"),
                "accounting_ok": None if cache is None else cache.get("accounting_ok"),
                "idle": None if cache is None else cache.get("idle"),
            }
        )
    return rows


def replica_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Which replica served what (from the per-request rows' `worker`): each replica's share of
    the completed requests, and per prefix group the share on its most used replica."""
    served = [r for r in rows if r["status"] == 200 and r["error"] is None and r["worker"]]
    by_worker = Counter(str(r["worker"]) for r in served)
    groups: dict[int, Counter[str]] = {}
    for r in served:
        groups.setdefault(int(r["group"]), Counter())[str(r["worker"])] += 1
    affinity: dict[str, dict[str, Any]] = {
        str(g): {"worker": c.most_common(1)[0][0], "share": c.most_common(1)[0][1] / c.total(),
                 "num_requests": c.total(), "by_worker": dict(c)}
        for g, c in sorted(groups.items())
    }  # fmt: skip
    streams = [r for r in rows if r["streamed"] and r["status"] == 200 and r["error"] is None]
    return {
        "requests_by_worker": dict(by_worker),
        "worker_share": {w: n / len(served) for w, n in by_worker.items()} if served else {},
        "group_affinity": affinity,
        "min_group_affinity": min((a["share"] for a in affinity.values()), default=None),
        "num_streams": len(streams),
        "num_streams_usage_then_done": sum(bool(r["usage_then_done"]) for r in streams),
    }


def _ms_percentiles(ms: Sequence[float]) -> dict[str, float]:
    values = np.asarray(ms, dtype=float)
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "mean": float(values.mean()),
    }


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
    if "followup_new_tokens_p50" in s:
        lines.append(
            f"follow-ups    {s['followup_new_tokens_p50']:.0f} new tokens over "
            f"{s['followup_cached_tokens_p50']:.0f} cached (medians)"
        )
    lines += [
        f"cached        {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens of completed "
        f"requests ({s['hit_rate']:.1%})",
    ]
    if s.get("server_prefill_tokens") is not None:
        ideal = s.get("ideal_prefill_tokens")
        lines.append(
            f"prefill       {s['server_prefill_tokens']} tokens computed by the server(s), "
            f"{ideal if ideal is not None else 'unknown'} for an ideal cache"
        )
    if s.get("served_efficiency") is not None:
        lines.append(
            f"engine        {s['served_efficiency']:.1%} of the wall time in forward passes "
            f"(served efficiency), {s['step_share']:.1%} in engine steps"
        )
    for name, label in (("timeline", "all"), ("root_timeline", "first turns"),
                        ("followup_timeline", "follow-ups")):  # fmt: skip
        if s.get(name):
            lines += format_timeline(s[name], label)
    if s.get("requests_by_worker"):
        shares = ", ".join(f"{w} {x:.0%}" for w, x in sorted(s["worker_share"].items()))
        lines.append(
            f"replicas      {shares}; each prefix group on one replica for at least "
            f"{s['min_group_affinity']:.0%} of its requests"
        )
    if s.get("num_streams"):
        lines.append(
            f"streams       {s['num_streams_usage_then_done']} of {s['num_streams']} ended "
            "with a usage chunk (cached_tokens), then [DONE]"
        )
    if s.get("errors_by_status"):
        lines.append(f"errors        {s['errors_by_status']} {s['first_errors']}")
    if s.get("leaked_slots") is not None:
        lines.append(
            f"server slots  {s['leaked_slots']} in flight after the run, accounting "
            f"{'ok' if s['accounting_ok'] else 'BROKEN'} (free + tree + in flight == capacity)"
        )
    return "\n".join(lines)


def format_timeline(t: dict[str, Any], label: str) -> list[str]:
    """A timeline summary as lines: the first token's p50 / p99, then each stage's p50 (ms)
    with its share of the summed p50s, the largest first."""
    first = t["first_token_ms"]
    lines = [
        f"timeline      {label}: first token p50 {first['p50']:.2f} ms  p99 {first['p99']:.2f} "
        f"ms over {t['num_requests']} requests; stage p50s:"
    ]
    stages = sorted(t["stages_ms"].items(), key=lambda kv: -kv[1]["p50"])
    total = sum(v["p50"] for _, v in stages) or 1.0
    cells = [f"{k} {v['p50']:.2f} ({v['p50'] / total:.0%})" for k, v in stages]
    for i in range(0, len(cells), 5):
        lines.append("                " + ", ".join(cells[i : i + 5]))
    return lines
