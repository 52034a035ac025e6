"""`radixlm bench cache`: replay a request trace through the radix tree and time each operation.

Per request, exactly as SGLang's tree benchmark (sglang_tree_bench.py) drives its tree (so the
two are comparable on the same trace):

    m = match(prompt)                                  hit tokens += m
    need = aligned(len(full)) - m                      tokens the request would allocate
    if cached + need > capacity: evict(cached + need - capacity)
    present = insert(full)                             full = prompt + output
    cached += aligned(len(full)) - present
    with --inflight W: lock the inserted node, unlock it W requests later

`--eviction` picks the L1 policy (lru | turn-credit | gdsf | adaptive); `--l2-capacity` adds a
simulated disk tier (bench/l2_sim.py: written through as each request finishes, or at L1
eviction by `--l2-write`) whose hits count separately. `--eval-from F` counts hits only over
the requests after the first fraction F (tune on the head of a trace, report on its tail), and
`--belady` adds, at the same capacity, LRU and Belady's clairvoyant hit rate (bench/belady.py)
and the share of the LRU -> Belady gap that the chosen policy closes in RAM alone.
Only tree operations are timed; slot ids are made outside the timed regions. requests/s is
requests divided by the time spent in match + insert + evict + lock/unlock.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixlm.bench.belady import belady
from radixlm.bench.l2_sim import KV_BYTES_PER_TOKEN, WRITE_RULES, L2Sim
from radixlm.bench.traces import TraceRequest
from radixlm.cache.policies import POLICIES
from radixlm.cache.radix_tree import RadixTree, TreeNode


@dataclass
class ReplayResult:
    """Counters and per-call latencies (seconds) of one replay."""

    requests: int
    prompt_tokens: int
    capacity_tokens: int | None
    page_size: int
    inflight: int
    hit_tokens: int = 0
    evicted_tokens: int = 0
    overflow_events: int = 0  # evictions that could not free enough (everything was locked)
    lock_s: float = 0.0
    match_s: list[float] = field(default_factory=list)
    insert_s: list[float] = field(default_factory=list)
    evict_s: list[float] = field(default_factory=list)
    final_cached_tokens: int = 0
    policy: str = "lru"
    eval_start: int = 0  # first request counted in the eval_* counters
    eval_prompt_tokens: int = 0
    eval_hit_tokens: int = 0  # L1 hits over the eval requests
    eval_l2_hit_tokens: int = 0
    l2: L2Sim | None = None

    @property
    def total_s(self) -> float:
        return sum(self.match_s) + sum(self.insert_s) + sum(self.evict_s) + self.lock_s

    def summary(self) -> dict[str, Any]:
        """The JSON object of `--json` (latencies in microseconds)."""
        total = self.total_s
        return {
            "requests": self.requests,
            "requests_per_s": round(self.requests / total, 1) if total else None,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": round(self.hit_tokens / max(1, self.prompt_tokens), 4),
            "match_p50_us": _percentile_us(self.match_s, 0.5),
            "match_p99_us": _percentile_us(self.match_s, 0.99),
            "insert_p50_us": _percentile_us(self.insert_s, 0.5),
            "insert_p99_us": _percentile_us(self.insert_s, 0.99),
            "evict_calls": len(self.evict_s),
            "evict_p50_us": _percentile_us(self.evict_s, 0.5),
            "evict_p99_us": _percentile_us(self.evict_s, 0.99),
            "evicted_tokens": self.evicted_tokens,
            "overflow_events": self.overflow_events,
            "capacity_tokens": self.capacity_tokens,
            "page_size": self.page_size,
            "inflight": self.inflight,
            "total_tree_s": round(total, 4),
            "final_cached_tokens": self.final_cached_tokens,
            "eviction": self.policy,
            **self._tier_summary(),
        }

    def _tier_summary(self) -> dict[str, Any]:
        """Hits over the eval requests by tier, and L2's traffic (over the whole replay)."""
        total = max(1, self.eval_prompt_tokens)
        hit = self.eval_hit_tokens + self.eval_l2_hit_tokens
        out: dict[str, Any] = {
            "eval_start": self.eval_start,
            "eval_prompt_tokens": self.eval_prompt_tokens,
            "eval_l1_hit_tokens": self.eval_hit_tokens,
            "eval_l1_hit_rate": round(self.eval_hit_tokens / total, 4),
            "eval_token_hit_rate": round(hit / total, 4),
        }
        if self.l2 is not None:
            out |= {
                "l2_capacity_tokens": self.l2.capacity,
                "l2_write": self.l2.write_rule,
                "eval_l2_hit_tokens": self.eval_l2_hit_tokens,
                "eval_l2_hit_rate": round(self.eval_l2_hit_tokens / total, 4),
                "l2_bytes_written": self.l2.written_tokens * KV_BYTES_PER_TOKEN,
                "l2_bytes_read": self.l2.read_tokens * KV_BYTES_PER_TOKEN,
                "l2_rejected_tokens": self.l2.rejected_tokens,
                "l2_evicted_tokens": self.l2.evicted_tokens,
            }
        return out


def replay(
    requests: list[TraceRequest],
    capacity: int | None = None,
    page_size: int = 1,
    inflight: int = 0,
    policy: str = "lru",
    l2_capacity: int | None = None,
    eval_start: int = 0,
    l2_write: str = "pressure",
) -> ReplayResult:
    """Drive a fresh RadixTree with `requests` (see the module docstring); None = unbounded.
    With `l2_capacity`, L1 evictions feed a simulated L2 tier of that many tokens, which writes
    what they evict by `l2_write` (bench/l2_sim.py's WRITE_RULES)."""
    tree = RadixTree(page_size=page_size, policy=policy)
    prompt_tokens = sum(r.prompt_len for r in requests)
    res = ReplayResult(len(requests), prompt_tokens, capacity, page_size, inflight)
    res.policy, res.eval_start = policy, eval_start
    l2 = None
    if l2_capacity:
        l2 = res.l2 = L2Sim(l2_capacity, tree.turns, page_size, write_rule=l2_write)
    if l2 is not None:
        tree.eviction_listener = l2.on_l1_evict
    clock = time.perf_counter
    pinned: deque[TreeNode] = deque()
    cached = next_slot = 0
    gc.collect()
    for index, request in enumerate(requests):
        full = request.full
        aligned = len(full) // page_size * page_size
        slots = np.arange(next_slot, next_slot + len(full), dtype=np.int64)
        next_slot += len(full)
        prompt = full[: request.prompt_len]
        t0 = clock()
        hit = tree.match(prompt).length
        res.match_s.append(clock() - t0)
        res.hit_tokens += hit
        l2_hit = l2.load(prompt, hit) if l2 is not None else 0
        if index >= eval_start:
            res.eval_prompt_tokens += request.prompt_len
            res.eval_hit_tokens += hit
            res.eval_l2_hit_tokens += l2_hit
        if capacity is not None and cached + aligned - hit > capacity:
            t0 = clock()
            freed = tree.evict(cached + aligned - hit - capacity).num_tokens
            res.evict_s.append(clock() - t0)
            res.overflow_events += freed < cached + aligned - hit - capacity
            res.evicted_tokens += freed
            cached -= freed
        t0 = clock()
        inserted = tree.insert(full, slots)
        res.insert_s.append(clock() - t0)
        if l2 is not None:
            l2.on_finish(inserted.node)
        cached += aligned - inserted.prefix_len
        if inflight > 0:
            t0 = clock()
            tree.lock(inserted.node)
            pinned.append(inserted.node)
            if len(pinned) > inflight:
                tree.unlock(pinned.popleft())
            res.lock_s += clock() - t0
    t0 = clock()
    while pinned:
        tree.unlock(pinned.popleft())
    res.lock_s += clock() - t0
    if cached != tree.num_tokens:
        raise RuntimeError(f"replay accounting: {cached} cached, the tree holds {tree.num_tokens}")
    res.final_cached_tokens = cached
    return res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, metavar="FILE", help="JSONL request trace")
    parser.add_argument(
        "--capacity", type=int, metavar="TOKENS", help="cache capacity in tokens (default: none)"
    )
    parser.add_argument("--page-size", type=int, default=1, metavar="N")
    parser.add_argument(
        "--inflight", type=int, default=0, metavar="N", help="keep the last N requests locked"
    )
    parser.add_argument(
        "--eviction", choices=sorted(POLICIES), default="lru", help="the L1 eviction policy"
    )
    parser.add_argument(
        "--l2-capacity", type=int, metavar="TOKENS", help="add a simulated L2 (disk) tier"
    )
    parser.add_argument(
        "--l2-write", choices=WRITE_RULES, default="pressure",
        help="what L2 writes of what RAM evicts: everything while it has room, then what the "
        "write filter keeps (pressure); what the filter keeps (filter); everything (all)",
    )  # fmt: skip
    parser.add_argument(
        "--eval-from", type=float, default=0.0, metavar="F",
        help="count hits only after the first fraction F of the requests (e.g. 0.6)",
    )  # fmt: skip
    parser.add_argument(
        "--belady", action="store_true",
        help="with --capacity: also LRU and Belady's clairvoyant hit rate, and the gap closed",
    )  # fmt: skip
    parser.add_argument(
        "--belady-block", type=int, default=512, metavar="N",
        help="Belady's unit in tokens: the trace's sharing grain (512 for Mooncake blocks, "
        "1 for token-id traces)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="OUT", help="write the results as one JSON object")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from radixlm.bench.host import describe_host
    from radixlm.bench.traces import TraceError, load_trace

    console = Console()
    for name in ("capacity", "page_size", "inflight"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "inflight" else 1):
            console.print(f"[red]error:[/] --{name.replace('_', '-')} must be positive")
            return 2
    try:
        requests = load_trace(args.trace)
    except (OSError, TraceError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    if not 0.0 <= args.eval_from < 1.0 or (args.l2_capacity is not None and args.l2_capacity < 1):
        console.print("[red]error:[/] --eval-from must be in [0, 1), --l2-capacity positive")
        return 2
    eval_start = int(args.eval_from * len(requests))
    summary = replay(
        requests, args.capacity, args.page_size, args.inflight,
        args.eviction, args.l2_capacity, eval_start, args.l2_write,
    ).summary()  # fmt: skip
    if args.belady and args.capacity:
        summary |= _against_belady(requests, args, eval_start, summary["eval_l1_hit_rate"])
    summary["trace"] = args.trace
    summary["host"] = describe_host()
    table = Table(title=f"radix tree replay of {args.trace}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, str(value))
    console.print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0


def _against_belady(
    requests: list[TraceRequest], args: argparse.Namespace, eval_start: int, l1_rate: float
) -> dict[str, Any]:
    """LRU and Belady at the same L1 capacity (RAM only) and the share of the gap closed."""
    lru = replay(requests, args.capacity, args.page_size, args.inflight, "lru", None, eval_start)
    lru_rate = lru.summary()["eval_l1_hit_rate"]
    oracle = belady(requests, args.capacity, args.belady_block, eval_start)
    belady_rate = round(oracle.hit_tokens / max(1, oracle.prompt_tokens), 4)
    gap = belady_rate - lru_rate
    return {
        "lru_l1_hit_rate": lru_rate,
        "belady_l1_hit_rate": belady_rate,
        "gap_closed": round((l1_rate - lru_rate) / gap, 4) if gap > 0 else None,
    }


def _percentile_us(seconds: list[float], q: float) -> float:
    """The q-quantile as sglang_tree_bench computes it (sorted[int(q * n)]), in microseconds."""
    if not seconds:
        return 0.0
    ordered = sorted(seconds)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)
