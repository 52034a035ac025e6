"""The disk tier and the eviction policies on traces they were not tuned on, as one JSON.

    python benchmarks/cache_traces.py --mooncake TRACE --out docs/bench/cache_traces.json

Traces: the Mooncake conversation trace, on whose first 60 % every constant was tuned, and the
synthetic shapes of bench/trace_shapes.py (chat, agent loops, few-shot blocks, long shared
documents, trees of thought), which tuned nothing. Every run replays a whole trace with 16
requests in flight (`radixlm bench cache`'s replay) and counts hits over its last 40 %.
Per trace, with RAM of `ram` tokens and a disk of `disk` (Mooncake: 1M and 12M; a synthetic
shape: RAM a 32nd of its distinct tokens, at least 32 of its longest prompts, and a disk 12
times that):
- each policy in RAM alone, Belady's clairvoyant hit rate at the same size, and the share of
  the LRU -> Belady gap each policy closes;
- LRU in RAM of ram + disk tokens (the same bytes, all in RAM);
- RAM + disk, LRU in RAM, for each of the L2 write rules (bench/l2_sim.py): the hit rate, and
  the KV bytes written per byte read back over the whole replay (the write bandwidth a rule
  spends on what it brings back).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from radixlm.bench.belady import belady
from radixlm.bench.cache_replay import replay
from radixlm.bench.host import describe_host
from radixlm.bench.l2_sim import WRITE_RULES
from radixlm.bench.trace_shapes import SHAPES, describe, shape_trace
from radixlm.bench.traces import TraceRequest, load_trace
from radixlm.cache.radix_tree import RadixTree

INFLIGHT = 16
EVAL_FROM = 0.6
POLICIES = ("lru", "turn-credit", "gdsf", "adaptive")
MOONCAKE = ("mooncake", 1_000_000, 12_000_000)  # the capacities the constants were tuned at


def run_trace(
    name: str, requests: list[TraceRequest], ram: int, disk: int, block: int, tuned: bool
) -> dict[str, Any]:
    """Every run of the module docstring on one trace."""
    t0 = time.perf_counter()
    start = int(EVAL_FROM * len(requests))
    oracle = belady(requests, ram, block, eval_start=start)
    runs: dict[str, Any] = {"belady": round(oracle.hit_tokens / max(1, oracle.prompt_tokens), 4)}
    for policy in POLICIES:
        runs[policy] = _rate(replay(requests, ram, 1, INFLIGHT, policy, None, start).summary())
    runs["lru_ram_and_disk"] = _rate(
        replay(requests, ram + disk, 1, INFLIGHT, "lru", None, start).summary()
    )
    tiered = {}
    for rule in WRITE_RULES:
        s = replay(requests, ram, 1, INFLIGHT, "lru", disk, start, rule).summary()
        written, read = s["l2_bytes_written"], s["l2_bytes_read"]
        tiered[rule] = {
            "hit_rate": s["eval_token_hit_rate"],
            "l2_hit_rate": s["eval_l2_hit_rate"],
            "bytes_written": written,
            "bytes_read": read,
            "written_per_read": round(written / read, 2) if read else None,
            "rejected_tokens": s["l2_rejected_tokens"],
            "evicted_tokens": s["l2_evicted_tokens"],
        }
    gap = runs["belady"] - runs["lru"]
    closed = {p: round((runs[p] - runs["lru"]) / gap, 4) if gap > 0 else None for p in POLICIES}
    return {
        "name": name,
        "tuned_on": tuned,
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "ram": ram,
        "disk": disk,
        "belady_block": block,
        "runs": runs,
        "gap_closed": {p: v for p, v in closed.items() if p != "lru"},
        "tiered": tiered,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def shape_capacities(requests: list[TraceRequest]) -> tuple[int, int]:
    """RAM and disk tokens for a synthetic shape (see the module docstring)."""
    tree = RadixTree()
    for r in requests:
        tree.insert(r.full, np.zeros(len(r.full), dtype=np.int64))
    longest = max(r.prompt_len for r in requests)
    ram = -(-max(tree.num_tokens // 32, 32 * longest) // 1000) * 1000
    return ram, 12 * ram


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake", required=True, help="conversation_trace.jsonl (read in place)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    args = ap.parse_args(argv)
    traces = []
    name, ram, disk = MOONCAKE
    traces.append(run_trace(name, load_trace(args.mooncake), ram, disk, 512, tuned=True))
    _print(traces[-1])
    for shape in args.shapes:
        requests = shape_trace(shape)
        ram, disk = shape_capacities(requests)
        traces.append(run_trace(shape, requests, ram, disk, 64, tuned=False) | describe(shape))
        _print(traces[-1])
    record = {
        "command": "python benchmarks/cache_traces.py --mooncake "
        "mooncake_fast25/conversation_trace.jsonl --out docs/bench/cache_traces.json",
        "inflight": INFLIGHT,
        "eval_from": EVAL_FROM,
        "traces": traces,
        "host": describe_host(),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return 0


def _rate(summary: dict[str, Any]) -> float:
    return float(summary["eval_token_hit_rate"])


def _print(trace: dict[str, Any]) -> None:
    tiered = {rule: t["hit_rate"] for rule, t in trace["tiered"].items()}
    print(trace["name"], trace["ram"], trace["disk"], trace["runs"], trace["gap_closed"], tiered,
          f"{trace['wall_s']} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
