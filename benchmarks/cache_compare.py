"""Side-by-side comparison of radixlm's tree with SGLang's on identical traces, in one process.

Not part of `make test`: it needs SGLang, installed into its own venv as the header of SGLang's
tree benchmark (sglang_tree_bench.py) describes. Run it with that venv's Python, naming the
benchmark script and the Mooncake trace (or setting RADIXLM_SGLANG_BENCH / RADIXLM_MOONCAKE):

    PYTHONPATH=. SGLANG_VENV/bin/python benchmarks/cache_compare.py \
        --sglang-bench PATH/sglang_tree_bench.py --mooncake PATH/conversation_trace.jsonl

Each case replays one trace three ways: radixlm through `cache_replay.replay`, radixlm behind
SGLang's adapter interface and driver (`RadixlmAdapter`), and the SGLang adapter `--impl`
(default sglang-unified: 0.5.23's Rust-core tree) through that driver. The three alternate
`--repeat` times (once for Mooncake) and each keeps its fastest run, so all see the same
machine load. The workloads are SGLang's generators: branching, multiturn and unique, at
unbounded capacity and at half the working set, plus unique with 8,000 resident leaves (the
eviction cost) and the Mooncake trace at fixed capacities.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from array import array
from types import ModuleType
from typing import Any

import numpy as np

from radixlm.bench.cache_replay import replay
from radixlm.bench.traces import TraceRequest, load_trace
from radixlm.cache.radix_tree import RadixTree, TreeNode

DEFAULT_SGLANG_BENCH = os.environ.get("RADIXLM_SGLANG_BENCH", "")
DEFAULT_MOONCAKE = os.environ.get("RADIXLM_MOONCAKE", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-bench", default=DEFAULT_SGLANG_BENCH, metavar="PATH")
    ap.add_argument("--impl", default="sglang-unified", help="an ADAPTERS name of that script")
    ap.add_argument("--repeat", type=int, default=3, help="keep the fastest of N runs per side")
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--mooncake", default=DEFAULT_MOONCAKE, help="'' skips the Mooncake cases")
    ap.add_argument("--mooncake-capacity", type=int, nargs="*", default=[1_000_000, 3_000_000])
    ap.add_argument("--only", nargs="*", help="run only these cases (names as printed)")
    ap.add_argument("--json", metavar="OUT", help="append one JSON row per case")
    args = ap.parse_args(argv)
    if not args.sglang_bench:
        ap.error(
            "name SGLang's tree benchmark script: --sglang-bench PATH (or RADIXLM_SGLANG_BENCH)"
        )

    sb = _import_path("sglang_tree_bench", args.sglang_bench)
    cases: list[tuple[str, Any, int | None]] = []
    for trace in (sb.gen_branching_trace(), sb.gen_multiturn_trace(), sb.gen_unique_trace()):
        cases.append((f"{trace.name}/unbounded", trace, None))
        cases.append((f"{trace.name}/half", trace, trace.unique_tokens // 2))
    # 16,000 unique requests at half their size: about 8,000 evictable leaves at every eviction
    evict_trace = sb.gen_unique_trace(n_reqs=16_000)
    cases.append(("unique-16k/8k-leaves", evict_trace, evict_trace.unique_tokens // 2))
    rows = []
    for name, trace, capacity in cases:
        if not args.only or name in args.only:
            rows.append(_compare(sb, args, name, trace, capacity, args.repeat))
    if args.mooncake:
        for capacity in args.mooncake_capacity:
            name = f"mooncake/{capacity}"
            if not args.only or name in args.only:
                trace = _sglang_trace(sb, load_trace(args.mooncake), "mooncake")
                rows.append(_compare(sb, args, name, trace, capacity, 1))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


def _compare(sb: ModuleType, args: argparse.Namespace, name: str, trace: Any,
             capacity: int | None, repeat: int) -> dict[str, Any]:  # fmt: skip
    ours = [TraceRequest(np.frombuffer(r.full, dtype=np.int64), len(r.prompt))
            for r in trace.requests]  # fmt: skip
    best_ours: dict[str, Any] = {}
    best_driven: dict[str, Any] = {}
    best_theirs: dict[str, Any] = {}
    for _ in range(repeat):
        mine = replay(ours, capacity, inflight=args.inflight).summary()
        best_ours = _faster(best_ours, mine)
        driven = sb.run_trace(RadixlmAdapter(), trace, capacity=capacity, inflight=args.inflight)
        best_driven = _faster(best_driven, driven.summary())
        adapter = sb.ADAPTERS[args.impl]()
        theirs = sb.run_trace(adapter, trace, capacity=capacity, inflight=args.inflight)
        best_theirs = _faster(best_theirs, theirs.summary())
    row = {
        "case": name,
        "capacity_tokens": capacity,
        "inflight": args.inflight,
        "sglang_impl": best_theirs["impl"],
        "radixlm_requests_per_s": best_ours["requests_per_s"],
        "radixlm_sglang_driver_requests_per_s": best_driven["requests_per_s"],
        "sglang_requests_per_s": best_theirs["requests_per_s"],
        "speedup": round(best_ours["requests_per_s"] / best_theirs["requests_per_s"], 2),
        "speedup_sglang_driver": round(
            best_driven["requests_per_s"] / best_theirs["requests_per_s"], 2
        ),
        "radixlm_hit_rate": best_ours["token_hit_rate"],
        "sglang_hit_rate": best_theirs["token_hit_rate"],
        "radixlm_match_p50_us": best_ours["match_p50_us"],
        "sglang_match_p50_us": best_theirs["match_p50_us"],
        "radixlm_evict_p50_us": best_ours["evict_p50_us"],
        "sglang_evict_p50_us": best_theirs["evict_p50_us"],
        "evict_calls": best_ours["evict_calls"],
    }
    print(json.dumps(row), flush=True)
    return row


class RadixlmAdapter:
    """radixlm's tree behind the adapter interface of sglang_tree_bench.py, so that SGLang's own
    driver (separate prompt and full arrays, its timing) can time it too."""

    name = "radixlm"

    def __init__(self, page_size: int = 1) -> None:
        self.tree = RadixTree(page_size)
        self._next_slot = 0
        self._last: TreeNode | None = None

    def prepare(self, tokens: array) -> tuple[np.ndarray, np.ndarray]:
        n = len(tokens)
        slots = np.arange(self._next_slot, self._next_slot + n, dtype=np.int64)
        self._next_slot += n
        return np.frombuffer(tokens, dtype=np.int64), slots

    def match_prefix(self, key: tuple[np.ndarray, np.ndarray]) -> int:
        return self.tree.match(key[0]).length

    def insert(self, key: tuple[np.ndarray, np.ndarray]) -> int:
        result = self.tree.insert(key[0], key[1])
        self._last = result.node
        return result.prefix_len

    def evict(self, n_tokens: int) -> int:
        return self.tree.evict(n_tokens).num_tokens

    def pin_last_insert(self) -> TreeNode:
        assert self._last is not None
        self.tree.lock(self._last)
        return self._last

    def unpin(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def cached_tokens(self) -> int:
        return self.tree.num_tokens


def _faster(best: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return new if not best or new["total_tree_s"] < best["total_tree_s"] else best


def _sglang_trace(sb: ModuleType, requests: list[TraceRequest], name: str) -> Any:
    """Our parsed requests as the benchmark script's Trace (the same token ids)."""
    converted = []
    for r in requests:
        full = array("q")
        full.frombytes(r.full.tobytes())
        converted.append(sb.Request(prompt=full[: r.prompt_len], full=full))
    return sb.Trace(name, converted, -1, -1)


def _import_path(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    raise SystemExit(main())
