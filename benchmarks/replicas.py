"""The replicas acceptance benchmark: two radixlm replicas behind smg against one pooled replica.

    .venv/bin/python benchmarks/replicas.py                        # docs/bench/replicas.json
    .venv/bin/python benchmarks/replicas.py --groups 3 --per-group 3 --system-len 200 \\
        --json quick.json                                          # a quick look

Two replicas (1 thread, --num-slots 5120 each) behind smg; G prefix groups x P chat requests
(a system prompt of --system-len words per group, ~1 token each), interleaved, concurrency 4,
the last request of each group streamed. Runs, caches flushed before each:
  cache_aware   smg --policy cache_aware
  round_robin   smg --policy round_robin
  pooled        one replica with 2 threads and both pools' slots, addressed directly
  kill          smg cache_aware again, the second replica SIGKILLed part-way through
Each run records hit rate, computed prefill, each group's replica affinity, each replica's
share, non-2xx, the streams' usage-then-[DONE] check and each replica's accounting after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from radixlm.bench import online  # noqa: E402
from radixlm.bench.host import describe_host  # noqa: E402
from radixlm.bench.online_replicas import LocalCluster, Process  # noqa: E402

RUNS = ("cache_aware", "round_robin", "kill", "pooled")
KILL_AT = 0.4  # the kill run loses its replica this far into the cache_aware run's duration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--groups", type=int, default=7)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=1000, help="words per system prompt")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-slots", type=int, default=5120, help="per replica")
    parser.add_argument("--port", type=int, default=18600, help="first of the ports used")
    parser.add_argument("--smg-arg", action="append", default=[], help="passed to smg launch")
    parser.add_argument("--logs", default=None, help="process logs (default: a temporary dir)")
    parser.add_argument("--json", default=str(REPO / "docs" / "bench" / "replicas.json"))
    parser.add_argument("--runs", default=",".join(RUNS), help="a subset of " + ",".join(RUNS))
    parser.add_argument("--kill-after", type=float, default=None, help="seconds into the run")
    parser.add_argument(
        "--repeats", type=int, default=0, help="more cache_aware runs, workload seeds 1..N"
    )
    args = parser.parse_args()
    wanted = args.runs.split(",")
    config = {k: v for k, v in vars(args).items() if k not in ("logs", "json")}  # no local paths
    results: dict[str, Any] = {"host": describe_host(), "config": config, "runs": {}}
    runs = results["runs"]
    logs = Path(args.logs or tempfile.mkdtemp(prefix="radixlm-replicas-"))
    with LocalCluster(logs, model=args.model) as cluster:
        a, b = cluster.start_replicas(
            [args.port + 1, args.port + 2], 1, args.num_slots, worker_ids=["replica-a", "replica-b"]
        )
        for i, policy in enumerate(("cache_aware", "round_robin")):
            if policy in wanted:
                runs[policy] = run_behind_smg(cluster, args, [a, b], policy, args.port + 10 * i)
        for seed in range(1, args.repeats + 1):
            run = run_behind_smg(
                cluster, args, [a, b], "cache_aware", args.port + 30 + seed, seed=seed
            )
            results.setdefault("cache_aware_repeats", []).append(brief(run, seed))
        if "kill" in wanted:
            kill_after = args.kill_after
            if kill_after is None:
                ca = runs.get("cache_aware")
                kill_after = KILL_AT * ca["summary"]["duration_s"] if ca else 30.0
            runs["kill"] = run_behind_smg(
                cluster, args, [a, b], "cache_aware", args.port + 20, b, kill_after
            )
        cluster.stop(a, b)
        if "pooled" in wanted:
            pooled = cluster.start_replica(args.port + 3, 2, 2 * args.num_slots, worker_id="pooled")
            runs["pooled"] = run_bench(args, pooled.url, [pooled.url])
    if set(runs) == set(RUNS):
        results["targets"] = targets(runs)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"targets": results.get("targets")}, indent=2))
    print(f"wrote {args.json}")
    return 0


def run_behind_smg(
    cluster: LocalCluster,
    args: argparse.Namespace,
    replicas: list[Process],
    policy: str,
    port: int,
    victim: Process | None = None,
    kill_after_s: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    urls = [r.url for r in replicas]
    cluster.flush(urls)
    gateway = cluster.start_smg(urls, port, policy, *args.smg_arg)
    try:
        result = run_bench(args, gateway.url, urls, cluster, victim, kill_after_s, seed)
        result["smg_metrics"] = smg_metrics(port + 1000)
        return result
    finally:
        cluster.stop(gateway)


def smg_metrics(port: int) -> dict[str, float]:
    """smg's own view of the run: requests per worker, upstream statuses, retries, breaker."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    keep = ("smg_worker_requests_total{", "smg_router_upstream_responses_total{",
            "smg_worker_cb_outcomes_total{", "smg_worker_retry_backoff_seconds_count")  # fmt: skip
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith(keep) and value and float(value) != 0:
            out[name] = float(value)
    return out


def run_bench(
    args: argparse.Namespace,
    base_url: str,
    server_urls: list[str],
    cluster: LocalCluster | None = None,
    victim: Process | None = None,
    kill_after_s: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """One `bench serve` run; with a victim, SIGKILL it `kill_after_s` into the run."""
    parser = argparse.ArgumentParser()
    online.add_arguments(parser)
    argv = [
        "--base-url", base_url, "--workload", "gsp", "--prompt-format", "chat",
        "--stream", "one-per-group", "--concurrency", "4", "--token-range", "0:100000",
        "--timeout", "300", "--seed", str(seed), "--param", f"num_groups={args.groups}",
        "--param", f"prompts_per_group={args.per_group}",
        "--param", f"system_prompt_len={args.system_len}",
        "--param", f"question_len={args.question_len}", "--param", f"output_len={args.output_len}",
    ]  # fmt: skip
    for url in server_urls:
        argv += ["--server-url", url]
    bench_args = parser.parse_args(argv)
    workload = online.workload_from_args(bench_args)

    async def go() -> dict[str, Any]:
        task = asyncio.create_task(online.run_bench(bench_args, workload))
        if victim is not None and cluster is not None:
            await asyncio.sleep(kill_after_s)
            await asyncio.to_thread(cluster.kill, victim)
        return await task

    started = time.perf_counter()
    result = asyncio.run(go())
    result["wall_s"] = time.perf_counter() - started
    if victim is not None:
        result["killed"] = {"replica": victim.url, "after_s": kill_after_s}
    print(f"--- {base_url} ({len(server_urls)} server(s)) ---")
    from radixlm.bench.online_stats import format_summary

    print(format_summary(result["summary"]))
    return result


def brief(run: dict[str, Any], seed: int) -> dict[str, Any]:
    s = run["summary"]
    keys = ("hit_rate", "server_prefill_tokens", "ideal_prefill_tokens", "worker_share",
            "min_group_affinity", "num_errors")  # fmt: skip
    return {"seed": seed, **{k: s.get(k) for k in keys}}


def targets(runs: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with its figures and whether it holds."""
    ca, rr, pooled = (runs[k]["summary"] for k in ("cache_aware", "round_robin", "pooled"))
    kill = runs["kill"]
    shares = list(ca["worker_share"].values())
    lost = [r for r in kill["requests"] if r["status"] != 200 or r["error"] is not None]
    hung = [r for r in lost if "Timeout" in str(r["error"])]
    out = {
        "hit_rate": {"cache_aware": ca["hit_rate"], "round_robin": rr["hit_rate"],
                     "pooled": pooled["hit_rate"]},
        "hit_rate_within_5_points_of_pooled": abs(ca["hit_rate"] - pooled["hit_rate"]) <= 0.05,
        "hit_rate_25_points_above_round_robin": ca["hit_rate"] - rr["hit_rate"] >= 0.25,
        "prefill": {"cache_aware": ca.get("server_prefill_tokens"),
                    "round_robin": rr.get("server_prefill_tokens"),
                    "pooled": pooled.get("server_prefill_tokens")},
        "min_group_affinity": ca["min_group_affinity"],
        "group_affinity_at_least_95": (ca["min_group_affinity"] or 0) >= 0.95,
        "worker_share": ca["worker_share"],
        "each_replica_30_to_70": len(shares) == 2 and all(0.3 <= s <= 0.7 for s in shares),
        "non_2xx": {k: sum(r["status"] != 200 for r in runs[k]["requests"]) for k in runs},
        "errors": {k: runs[k]["summary"]["num_errors"] for k in runs},  # stream errors too
        "streams_usage_then_done": {
            k: f"{runs[k]['summary']['num_streams_usage_then_done']}/"
            f"{runs[k]['summary']['num_streams']}" for k in runs
        },
        "accounting_after_each_run": {
            k: [(s["url"], s["accounting_ok"], s["num_in_flight"]) for s in rows["servers"]]
            for k, rows in ((k, runs[k]["summary"]) for k in runs)
        },
        "kill": {"lost": len(lost), "hung": len(hung),
                 "succeeded": len(kill["requests"]) - len(lost), "of": len(kill["requests"]),
                 "by_worker": kill["summary"]["requests_by_worker"],
                 "smg": kill.get("smg_metrics")},
    }  # fmt: skip
    ratio = None
    if out["prefill"]["cache_aware"] and out["prefill"]["pooled"]:
        ratio = out["prefill"]["cache_aware"] / out["prefill"]["pooled"]
    out["prefill_vs_pooled"] = ratio
    out["prefill_at_most_1_15_pooled"] = ratio is not None and ratio <= 1.15
    return out


if __name__ == "__main__":
    sys.exit(main())
