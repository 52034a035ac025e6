"""The eviction-policy and L2-tier matrix of `radixlm bench cache`, written as one JSON.

    python benchmarks/cache_tiers.py --trace FILE --out docs/bench/cache_tiers.json

Every run replays the whole trace (16 requests in flight, page size 1) and counts hits over the
requests after `--eval-from` (default 0.6: the policies were tuned on the head of the trace).
RAM-only runs also carry LRU's and Belady's hit rates at the same capacity and the share of
that gap the policy closes; tiered runs add an L2 of `--l2-capacity` tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from radixlm.bench.belady import belady
from radixlm.bench.cache_replay import replay
from radixlm.bench.host import describe_host
from radixlm.bench.traces import TraceRequest, load_trace
from radixlm.cache.policies import POLICIES

INFLIGHT = 16


def run_matrix(
    requests: list[TraceRequest],
    capacities: list[int],
    l2_capacity: int,
    eval_from: float,
    policies: list[str],
) -> list[dict[str, Any]]:
    """One summary per (policy, capacity) in RAM only, and per policy with L2 at the smallest."""
    eval_start = int(eval_from * len(requests))
    runs: list[dict[str, Any]] = []
    for capacity in capacities:
        oracle = belady(requests, capacity, eval_start=eval_start)
        belady_rate = round(oracle.hit_tokens / max(1, oracle.prompt_tokens), 4)
        lru_rate = None
        for policy in policies:
            t0 = time.perf_counter()
            s = replay(requests, capacity, 1, INFLIGHT, policy, None, eval_start).summary()
            rate = s["eval_l1_hit_rate"]
            lru_rate = rate if policy == "lru" else lru_rate
            gap = belady_rate - lru_rate if lru_rate is not None else None
            s |= {
                "belady_l1_hit_rate": belady_rate,
                "lru_l1_hit_rate": lru_rate,
                "gap_closed": round((rate - lru_rate) / gap, 4) if gap else None,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            runs.append(_trim(s))
    for policy in policies:
        t0 = time.perf_counter()
        s = replay(
            requests, min(capacities), 1, INFLIGHT, policy, l2_capacity, eval_start
        ).summary()
        s["wall_s"] = round(time.perf_counter() - t0, 1)
        runs.append(_trim(s))
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--capacity", type=int, nargs="+", default=[1_000_000, 3_000_000])
    ap.add_argument("--l2-capacity", type=int, default=12_000_000)
    ap.add_argument("--eval-from", type=float, default=0.6)
    ap.add_argument("--policies", nargs="+", default=["lru", *sorted(set(POLICIES) - {"lru"})])
    args = ap.parse_args(argv)
    requests = load_trace(args.trace)
    runs = run_matrix(requests, args.capacity, args.l2_capacity, args.eval_from, args.policies)
    record = {
        "trace": "mooncake_fast25/conversation_trace.jsonl"
        if "mooncake" in args.trace
        else args.trace.rsplit("/", 1)[-1],
        "requests": len(requests),
        "eval_from": args.eval_from,
        "inflight": INFLIGHT,
        "runs": runs,
        "host": describe_host(),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    for s in runs:
        print(
            s["eviction"], s["capacity_tokens"], s.get("l2_capacity_tokens"),
            s["eval_l1_hit_rate"], s["eval_token_hit_rate"], s.get("gap_closed"),
        )  # fmt: skip
    return 0


def _trim(summary: dict[str, Any]) -> dict[str, Any]:
    """A run without the trace path (the record names it once)."""
    return {k: v for k, v in summary.items() if k != "trace"}


if __name__ == "__main__":
    raise SystemExit(main())
