"""Speculation on and off, side by side: output tokens per second through the server.

    python benchmarks/speculation.py [--agents 8] [--steps 10] [--dtype float32]
                                     [--workloads agent_tools code_edit structured random]
                                     [--json docs/bench/speculation.json]

For each workload (speculation_workload.py) the default model is served in this process twice,
with `--speculate off` and then `auto`, and the same clients run against each: the two runs
of a workload sit next to each other in time, so a busy host tilts both alike. Per run: wall
time, completion tokens, output tok/s, engine steps, drafted and accepted tokens (the usage's
`speculation`), decode forwards per output token of a request ((completion - accepted) /
completion: one forward gives one token plus the draft tokens it kept), and whether every
output is identical to the `off` run's (greedy, and the random workload seeded).

Targets (issue 27): agent workloads >= 2 output tokens per decode forward and >= 1.8x output
tok/s; constrained output <= 0.6 forwards per output token; random within 3 % of off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import speculation_workload as wl
from openai import AsyncOpenAI

from radixlm.bench.host import describe_host

MODES = ("off", "auto")


async def run_workload(url: str, name: str, args: argparse.Namespace) -> list[wl.Record]:
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    salt = f"spec-{name}-{time.time_ns()}"
    try:
        if name == "agent_tools":
            return await wl.agent_tools(client, model, salt, args.agents, args.steps)
        if name == "code_edit":
            return await wl.code_edit(client, model, salt, args.editors, args.edits)
        if name == "structured":
            return await wl.structured(client, model, salt, args.requests)
        return await wl.random_tokens(client, model, salt, args.requests)
    finally:
        await client.close()


def engine_stats(url: str) -> dict[str, int]:
    return dict(httpx.get(url.removesuffix("/v1") + "/v1/cache", timeout=60).json()["engine_stats"])


def measure(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with wl.serve(mode, args.dtype, args.threads) as url:
        asyncio.run(warm_up(url))
        before = engine_stats(url)
        start = time.perf_counter()
        records = asyncio.run(run_workload(url, name, args))
        elapsed = time.perf_counter() - start
        after = engine_stats(url)
    tokens = sum(r["completion_tokens"] for r in records)
    accepted = sum(r["accepted_tokens"] for r in records)
    run = {
        "mode": mode, "elapsed_s": round(elapsed, 2), "requests": len(records),
        "completion_tokens": tokens, "output_tok_s": round(tokens / elapsed, 2),
        "engine_steps": after["steps"] - before["steps"],
        "drafted_tokens": sum(r["drafted_tokens"] for r in records), "accepted_tokens": accepted,
        "forwards_per_output_token": round((tokens - accepted) / max(tokens, 1), 3),
        "records": records,
    }  # fmt: skip
    print(f"{name:12s} {mode:4s} {elapsed:7.1f} s {tokens:6d} tok {run['output_tok_s']:7.2f} tok/s"
          f"  accepted {accepted}/{run['drafted_tokens']}"
          f"  forwards/token {run['forwards_per_output_token']}", file=sys.stderr)  # fmt: skip
    return run


async def warm_up(url: str) -> None:
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    await client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    await client.close()


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    off, on = runs["off"], runs["auto"]
    same = [a["output"] == b["output"] for a, b in zip(off["records"], on["records"])]
    return {
        "speedup": round(on["output_tok_s"] / off["output_tok_s"], 3),
        "tokens_per_decode_forward": round(1 / max(on["forwards_per_output_token"], 1e-9), 2),
        "identical_outputs": f"{sum(same)}/{len(same)}",
        "all_identical": all(same) and len(off["records"]) == len(on["records"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["agent_tools", "code_edit",
                        "structured", "random"])  # fmt: skip
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--editors", type=int, default=4)
    parser.add_argument("--edits", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "host": describe_host(), "model": f"default (SmolLM2-135M-Instruct Q4_1), {args.dtype}",
        "threads": args.threads, "argv": sys.argv[1:], "workloads": {},
    }  # fmt: skip
    for name in args.workloads:
        runs = {mode: measure(name, mode, args) for mode in MODES}
        summary = compare(runs)
        print(f"{name:12s} speedup {summary['speedup']}x, {summary['identical_outputs']} "
              f"identical", file=sys.stderr)  # fmt: skip
        result["workloads"][name] = {"summary": summary, "runs": runs}
    table = [(n, w["summary"], w["runs"]) for n, w in result["workloads"].items()]
    print(
        "| workload | off tok/s | auto tok/s | speedup | forwards/token | accepted/drafted "
        "| identical |\n|---|---|---|---|---|---|---|"
    )
    for n, s, r in table:
        print(
            f"| {n} | {r['off']['output_tok_s']} | {r['auto']['output_tok_s']} | "
            f"{s['speedup']}x | {r['auto']['forwards_per_output_token']} | "
            f"{r['auto']['accepted_tokens']}/{r['auto']['drafted_tokens']} | "
            f"{s['identical_outputs']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
