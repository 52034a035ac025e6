"""What cache reports cost a server: every request asking for one against none.

    python benchmarks/observatory_overhead.py [--rounds 16] [--concurrency 4]
                                              [--json docs/bench/observatory_overhead.json]

`radixlm serve` (the default model) runs in a child process; this process drives it with
`radixlm bench serve`'s client: chat prompts to /v1/chat/completions, streamed, greedy, EOS
ignored. Each round runs each workload (gsp, multiturn) twice, with `return_cache_report` on
every request and without, in alternating order (off-on, then on-off), and the cache is flushed
before each run: both arms do the same work from the same empty tree. Per workload the figure is
the output tok/s of "on" over "off", paired within each round: its median over the rounds, with
a distribution-free interval of that median (order statistics, about 95 %). Beside it, the
server process's CPU time per run (user + system, from /proc), paired the same way: on a shared
host the CPU a run used moves far less with the load than its wall time does. The server's own
counter (`radixlm_cache_reports_total`) checks that "on" explained every request, "off" none.

Also timed here, in this process (`--components-only` refreshes just these in an existing
JSON): what every request pays (`PromptIndex.record`, the salt check's index) and a report's
index lookup, on a 2,048-token prompt; and the whole work of one report (probe, chat segments,
explanation) on a gsp prompt whose sibling is cached, with the default model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import timeit
from argparse import Namespace
from pathlib import Path
from typing import Any

import httpx

from radixlm.bench.host import describe_host
from radixlm.bench.online import run_bench, workload_from_args
from radixlm.bench.online_replicas import wait_until_healthy

WORKLOADS = {  # small, so that many interleaved rounds fit on a shared 2-core host
    "gsp": ["num_groups=2", "prompts_per_group=4", "system_prompt_len=256", "question_len=32",
            "output_len=16"],
    "multiturn": ["num_conversations=4", "num_turns=3", "turn_len=64", "output_len=16"],
}  # fmt: skip
REPORTS = "radixlm_cache_reports_total{"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=None, help="the server's threads")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--components-only", action="store_true", help="refresh components")
    args = parser.parse_args()
    if args.components_only:
        if not args.json:
            raise SystemExit("--components-only updates the file named by --json")
        path = Path(args.json)
        old = json.loads(path.read_text())
        old["components"] = component_costs()
        path.write_text(json.dumps(old, indent=1) + "\n")
        print("components:", json.dumps(old["components"]))
        return
    result: dict[str, Any] = {
        "command": "python benchmarks/observatory_overhead.py " + " ".join(sys.argv[1:]),
        "host": describe_host(),
        "model": f"default (SmolLM2-135M-Instruct Q4_1), {args.dtype}",
        "concurrency": args.concurrency,
        "num_threads": args.num_threads,
        "rounds": args.rounds,
        "workloads": {},
        "components": component_costs(),
    }
    with serve(args.dtype, args.num_threads) as server:
        runs = asyncio.run(run_rounds(server, args.rounds, args.concurrency))
    for name in WORKLOADS:
        result["workloads"][name] = summarize(name, [r for r in runs if r["workload"] == name])
    result["runs"] = runs
    for name, w in result["workloads"].items():
        print(f"{name}: tok/s on/off {w['ratio_median']:.4f} [{w['ratio_low']:.4f}, "
              f"{w['ratio_high']:.4f}]; off {w['off_tok_s_median']:.1f} tok/s, "
              f"on {w['on_tok_s_median']:.1f}; CPU on/off {w['cpu_ratio_median']:.4f} "
              f"[{w['cpu_ratio_low']:.4f}, {w['cpu_ratio_high']:.4f}]")  # fmt: skip
    print("components:", json.dumps(result["components"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


async def run_rounds(server: serve, rounds: int, concurrency: int) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    base = server.base
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for r in range(rounds):
            for name, params in WORKLOADS.items():
                for on in (False, True) if r % 2 == 0 else (True, False):
                    await client.post("/v1/cache/flush")
                    before, cpu = await reports_counted(client), server.cpu_s()
                    summary = await one_run(base, name, params, concurrency, on)
                    cpu = server.cpu_s() - cpu
                    explained = await reports_counted(client) - before
                    runs.append({
                        "round": r, "workload": name, "reports": on,
                        "output_tok_s": round(summary["output_tok_s"], 3),
                        "duration_s": round(summary["duration_s"], 3), "cpu_s": round(cpu, 3),
                        "ttft_p50_ms": round(summary["ttft_p50_ms"], 1),
                        "num_requests": summary["num_requests"],
                        "num_errors": summary["num_errors"], "explained": explained,
                    })  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
                    if summary["num_errors"] or explained != (summary["num_requests"] if on else 0):
                        raise SystemExit(f"run failed or miscounted: {runs[-1]}")
    return runs


async def one_run(
    base: str, workload: str, params: list[str], concurrency: int, on: bool
) -> dict[str, Any]:
    args = Namespace(
        base_url=base, server_url=[], model=None, api_key=None, workload=workload, param=params,
        token_range="1000:30000", prompt_format="chat", stream="all", concurrency=concurrency,
        rate=None, disconnect_frac=0.0, seed=0, no_ignore_eos=False, timeout=600.0,
        extra_body=json.dumps({"return_cache_report": True} if on else {}),
    )  # fmt: skip
    result = await run_bench(args, workload_from_args(args))
    summary: dict[str, Any] = result["summary"]
    return summary


async def reports_counted(client: httpx.AsyncClient) -> int:
    text = (await client.get("/metrics")).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(REPORTS)))  # fmt: skip


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per arm, and the paired on/off ratio's median with its order-statistic
    interval."""
    off = {r["round"]: r["output_tok_s"] for r in runs if not r["reports"]}
    on = {r["round"]: r["output_tok_s"] for r in runs if r["reports"]}
    ratios = sorted(on[k] / off[k] for k in off)
    low, high = median_interval(ratios)
    median = statistics.median(ratios)
    cpu_off = {r["round"]: r["cpu_s"] for r in runs if not r["reports"]}
    cpu_on = {r["round"]: r["cpu_s"] for r in runs if r["reports"]}
    cpu_ratios = sorted(cpu_on[k] / cpu_off[k] for k in cpu_off)
    cpu_low, cpu_high = median_interval(cpu_ratios)
    cpu_median = statistics.median(cpu_ratios)
    return {
        "params": WORKLOADS[name],
        "off_tok_s_median": round(statistics.median(off.values()), 2),
        "on_tok_s_median": round(statistics.median(on.values()), 2),
        "ratio_median": round(median, 4),
        "ratio_low": round(low, 4),
        "ratio_high": round(high, 4),
        "cost": round(1 - median, 4),
        "off_cpu_s_median": round(statistics.median(cpu_off.values()), 3),
        "on_cpu_s_median": round(statistics.median(cpu_on.values()), 3),
        "cpu_ratio_median": round(cpu_median, 4),
        "cpu_ratio_low": round(cpu_low, 4),
        "cpu_ratio_high": round(cpu_high, 4),
        "cpu_cost": round(cpu_median - 1, 4),
    }


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free interval of the median of sorted `values`: the order statistics
    n/2 -+ z*sqrt(n)/2 (about 95 % for z = 1.96)."""
    n = len(values)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return values[lo], values[hi]


def component_costs() -> dict[str, float]:
    """Microseconds of the always-on record and the report's index lookup, 2,048 tokens."""
    import numpy as np

    from radixlm.observatory.salts import PromptIndex

    index = PromptIndex()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1000, 30000, 2048)] for _ in range(64)]
    for i, p in enumerate(prompts):
        index.record(p, f"tenant-{i % 8}")
    n = 2000
    record = timeit.timeit(lambda: index.record(prompts[7], "tenant-7"), number=n) / n
    others = timeit.timeit(lambda: index.others(prompts[7], "tenant-0"), number=n) / n
    prompt_len, report = report_cost()
    return {"prompt_len": 2048, "record_us": round(record * 1e6, 1),
            "others_us": round(others * 1e6, 1), "report_prompt_len": prompt_len,
            "report_ms": round(report * 1e3, 2)}  # fmt: skip


def report_cost() -> tuple[int, float]:
    """(prompt tokens, seconds) of one report's work, median of 30: a gsp-shaped chat (a
    256-word system prompt, a 32-word question) against a tree holding its sibling."""
    import numpy as np

    from radixlm.bench.online_prompts import render_words
    from radixlm.model.loader import default_model_path
    from radixlm.observatory.explain import explain
    from radixlm.observatory.probe import probe_tree
    from radixlm.observatory.replay import PromptReplay
    from radixlm.observatory.segments import chat_segments
    from radixlm.tokenizer import Tokenizer

    rng = np.random.default_rng(0)
    system = render_words(rng.integers(0, 10_000, 256).tolist())
    bodies = [[{"role": "system", "content": system},
               {"role": "user", "content": render_words(rng.integers(0, 10_000, 32).tolist())}]
              for _ in range(2)]  # fmt: skip
    replay = PromptReplay(Tokenizer.from_pretrained(default_model_path()))
    replay.request({"messages": bodies[0], "response": "A short answer."})
    ids = replay.renderer.prompt_ids(bodies[1], [], None)

    def one() -> None:
        segments = chat_segments(replay.renderer, bodies[1], ())
        others = replay.prompts.others(ids, None)
        probe = probe_tree(replay.tree, ids, None, others)
        explain(probe, ids, replay.decode, segments)

    times = [timeit.timeit(one, number=1) for _ in range(30)]
    return len(ids), statistics.median(times)


class serve:
    """`radixlm serve` in a child process on a free port (`base`, its URL), with its CPU time."""

    def __init__(self, dtype: str, num_threads: int | None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.dtype, self.num_threads = dtype, num_threads

    def __enter__(self) -> serve:
        command = [sys.executable, "-m", "radixlm", "serve", "--port", str(self.port),
                   "--dtype", self.dtype, "--log-level", "warning"]  # fmt: skip
        if self.num_threads is not None:
            command += ["--num-threads", str(self.num_threads)]
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.base = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(self.process, self.base, 300)
        return self

    def cpu_s(self) -> float:
        """The server process's CPU time so far (user + system, every thread), in seconds."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    main()
