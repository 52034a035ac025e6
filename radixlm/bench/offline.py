"""`radixlm bench offline`: a workload through the engine, radix cache against no cache.

Both cache modes run in one process, one after the other, on the same model and workload. A
request is submitted as soon as it may go (roots at once, children when their parent finishes);
its TTFT counts from that moment. Every request generates exactly its output_len tokens
(ignore_eos), greedy. The JSON holds, per cache mode, throughput, TTFT percentiles, the token
hit rate, and the prefill tokens the engine computed against the ideal (distinct prompt tokens
of the workload's prefix trie, see `workloads.ideal_prefill_tokens`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from typing import Any, cast

from radixlm.bench.workloads import add_workload_arguments, workload_from_args, workload_params

# Prompts draw token ids from here: past the special tokens, inside every model's vocabulary.
TOKEN_RANGE = range(1000, 30000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default model)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--cache", choices=["radix", "none", "both"], default="both")
    parser.add_argument("--num-slots", type=int, default=65_536, help="KV pool size in tokens")
    parser.add_argument("--max-running", type=int, default=64)
    # Offline throughput: bigger steps than the serving default (no stream waits on them).
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--policy", choices=["lpm", "fcfs"], default="lpm")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=None,
        metavar="N",
        help="submit at most N requests at a time, in workload order, the next when one finishes "
        "(as `bench serve --concurrency N` does); default: all at once",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="draw the comparison into this PNG")
    add_workload_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.in_flight is not None and args.in_flight < 1:
        raise SystemExit(f"--in-flight must be at least 1, got {args.in_flight}")
    from radixlm.bench.host import describe_host
    from radixlm.bench.report import plot_offline, print_offline

    modes = ["radix", "none"] if args.cache == "both" else [args.cache]
    results: dict[str, Any] = {
        "workload": args.workload,
        "params": workload_params(args),
        "seed": args.seed,
        "threads": args.threads,
        "dtype": args.dtype,
        "in_flight": args.in_flight,
        "model": args.model or "default (SmolLM2-135M-Instruct Q4_1)",
        "host": describe_host(),
        "modes": {},
    }
    for mode in modes:
        results["modes"][mode] = run_mode(args, mode)
    print_offline(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot_offline(results, args.plot)
    return 0


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Load an engine with `mode` and run the workload through it once."""
    from rich.progress import Progress

    from radixlm.api_types import SamplingParams
    from radixlm.bench.workloads import WorkloadProgress, ideal_prefill_tokens
    from radixlm.config import CacheConfig, CacheKind, ModelConfig, SchedulerConfig
    from radixlm.engine.engine import Engine
    from radixlm.engine.request import Request

    engine = Engine(
        ModelConfig(path=args.model, dtype=args.dtype, num_threads=args.threads),
        CacheConfig(num_slots=args.num_slots, cache=cast(CacheKind, mode)),
        SchedulerConfig(
            max_running_requests=args.max_running,
            max_batch_tokens=args.max_batch_tokens,
            chunk_size=args.chunk_size,
            policy=args.policy,
        ),
    )
    workload = workload_from_args(args, TOKEN_RANGE)
    _warm_up(engine)
    base = _snapshot(engine)
    progress = WorkloadProgress(workload)
    live: dict[str, tuple[int, Request]] = {}

    def submit(index: int) -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=workload.requests[index].output_len, ignore_eos=True
        )
        rid = engine.add_request(progress.prompt(index), params)
        live[rid] = (index, engine.requests(rid)[0])

    done: list[Request] = []
    step_s = {"prefill": 0.0, "decode": 0.0}  # time in steps that prefilled / only decoded
    pending = deque(progress.roots)  # dispatchable, in workload order

    def refill() -> None:
        while pending and (args.in_flight is None or len(live) < args.in_flight):
            submit(pending.popleft())

    start = time.perf_counter()
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{workload.name} / {mode}", total=len(workload.requests))
        refill()
        while engine.has_unfinished():
            prefilled, step_start = engine.stats.prefill_tokens, time.perf_counter()
            deltas = engine.step()
            kind = "prefill" if engine.stats.prefill_tokens > prefilled else "decode"
            step_s[kind] += time.perf_counter() - step_start
            for delta in deltas:
                if delta.finish_reason is None:
                    continue
                index, req = live.pop(delta.request_id)
                done.append(req)
                bar.advance(task)
                pending.extend(progress.finish(index, req.output_ids))
            refill()
    elapsed = time.perf_counter() - start
    engine.cache.check_integrity()
    summary = _summary(engine, base, done, elapsed, ideal_prefill_tokens(progress.completed()))
    summary["prefill_steps_s"], summary["decode_steps_s"] = step_s["prefill"], step_s["decode"]
    return summary


def _warm_up(engine: Any) -> None:
    """One short request (first-call costs), then an empty cache for the measured run."""
    from radixlm.api_types import SamplingParams

    engine.add_request(list(TOKEN_RANGE[:16]), SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.cache.flush()


def _snapshot(engine: Any) -> dict[str, int]:
    s = engine.stats
    return {
        "prefill": s.prefill_tokens,
        "decode": s.decode_tokens,
        "prompt": s.prompt_tokens,
        "cached": s.cached_prompt_tokens,
        "steps": s.steps,
    }


def _summary(
    engine: Any, base: dict[str, int], done: list[Any], elapsed: float, ideal: int
) -> dict[str, Any]:
    import numpy as np

    now = _snapshot(engine)
    delta = {k: now[k] - base[k] for k in now}
    ttft_ms = np.array([(r.first_token_time - r.arrival_time) * 1000 for r in done])
    output_tokens = sum(len(r.output_ids) for r in done)
    return {
        "requests": len(done),
        "duration_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
        "prompt_tokens": delta["prompt"],
        "cached_prompt_tokens": delta["cached"],
        "token_hit_rate": delta["cached"] / max(1, delta["prompt"]),
        "prefill_tokens": delta["prefill"],
        "ideal_prefill_tokens": ideal,
        "prefill_over_ideal": delta["prefill"] / max(1, ideal),
        "decode_tokens": delta["decode"],
        "steps": delta["steps"],
        "output_tokens": output_tokens,
        "retractions": engine.scheduler.num_retractions,
    }
