"""`radixlm bench serve`: load an OpenAI-compatible server with a workload, over HTTP.

    python -m radixlm bench serve --base-url http://127.0.0.1:8000 --workload multiturn \\
        --concurrency 64 [--rate R] [--disconnect-frac 0.2] [--json OUT]

Requests go out as streamed /v1/completions with token-id prompts, at most `concurrency` at once,
arriving as a Poisson process of `rate` per second (all at once without it). A request with a
parent waits for it and extends its actual output (multi-turn, tree of thought, agent loops).
A `--disconnect-frac` share of the requests hang up at a random token, as impatient clients do.

Reported: TTFT and inter-token latency p50/p99, throughput, errors by status (5xx counted apart),
and, when the server is radixlm, its slot accounting once the load is gone (`/v1/cache`): a
leaked slot would show as in-flight slots left with no request running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_SETTLE_S = 30.0  # how long the server gets to return every slot after the load


@dataclass(frozen=True)
class PlannedRequest:
    rid: str
    prompt_ids: list[int]  # with a parent: the tokens appended after the parent's output
    output_len: int
    parent: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from radixlm.bench.online_plan import add_workload_arguments

    parser.add_argument("--base-url", required=True, help="the server, without /v1")
    parser.add_argument("--model", default=None, help="the model id (default: /v1/models)")
    parser.add_argument("--api-key", default=None)
    add_workload_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (Poisson)")
    parser.add_argument(
        "--disconnect-frac", type=float, default=0.0, help="share of clients hanging up mid-way"
    )
    parser.add_argument("--seed", type=int, default=0, help="arrivals and disconnects")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from radixlm.bench.online_plan import plan_from_args

    if args.concurrency < 1 or not 0.0 <= args.disconnect_frac <= 1.0:
        print("--concurrency must be >= 1 and --disconnect-frac in [0, 1]", file=sys.stderr)
        return 2
    plan = plan_from_args(args)
    result = asyncio.run(run_bench(args, plan))
    print(format_summary(result["summary"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


async def run_bench(args: argparse.Namespace, plan: list[PlannedRequest]) -> dict[str, Any]:
    import httpx

    from radixlm.bench.online_client import ClientOptions, stream_completion
    from radixlm.bench.online_stats import summarize

    base = args.base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = args.model or await _served_model(client, base, args.api_key)
        options = ClientOptions(base, model, args.api_key, ignore_eos=not args.no_ignore_eos)
        rng = random.Random(args.seed)
        arrivals = _arrivals(len(plan), args.rate, rng)
        disconnects = [
            rng.randint(1, max(1, r.output_len - 1))
            if rng.random() < args.disconnect_frac
            else None
            for r in plan
        ]
        done = {r.rid: asyncio.Event() for r in plan}
        records: dict[str, Any] = {}
        prompts: dict[str, list[int]] = {}
        slots = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()

        async def one(i: int, req: PlannedRequest) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            if req.parent is not None:
                await done[req.parent].wait()
                parent = records[req.parent]
                prompt = prompts[req.parent] + parent.output_ids + req.prompt_ids
            else:
                prompt = list(req.prompt_ids)
            prompts[req.rid] = prompt
            async with slots:
                records[req.rid] = await stream_completion(
                    client, options, req.rid, prompt, req.output_len, disconnects[i]
                )
            done[req.rid].set()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(plan)))
        duration = time.perf_counter() - start
        cache = await _settled_cache(client, base, args.api_key)
    ordered = [records[r.rid] for r in plan]
    return {
        "config": {
            "base_url": base,
            "model": model,
            "workload": args.workload,
            "concurrency": args.concurrency,
            "rate": args.rate,
            "disconnect_frac": args.disconnect_frac,
            "seed": args.seed,
            "num_requests": len(plan),
        },
        "summary": summarize(ordered, duration, cache),
        "server_cache": cache,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"requests      {s['num_requests']} ({s['num_ok']} ok, {s['num_disconnected']} hung up "
        f"on purpose, {s['num_errors']} errors, {s['num_5xx']} 5xx)",
        f"duration      {s['duration_s']:.2f} s",
        f"throughput    {s['output_tok_s']:.1f} output tok/s, {s['request_s']:.2f} req/s",
        f"TTFT          p50 {s['ttft_p50_ms']:.1f} ms   p99 {s['ttft_p99_ms']:.1f} ms",
        f"ITL           p50 {s['itl_p50_ms']:.1f} ms   p99 {s['itl_p99_ms']:.1f} ms",
        f"cached        {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens "
        f"(completed requests: {s['hit_rate']:.1%})",
    ]
    if s.get("errors_by_status"):
        lines.append(f"errors        {s['errors_by_status']}")
    if s.get("leaked_slots") is not None:
        lines.append(
            f"server slots  {s['leaked_slots']} leaked, accounting "
            f"{'ok' if s['accounting_ok'] else 'BROKEN'} (free + tree + in flight == capacity)"
        )
    return "\n".join(lines)


# ---- helpers --------------------------------------------------------------------------------
async def _served_model(client: Any, base: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await client.get(f"{base}/v1/models", headers=headers)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _settled_cache(client: Any, base: str, api_key: str | None) -> dict[str, Any] | None:
    """radixlm's /v1/cache once no request is left (aborts land asynchronously); None when the
    server has no such route."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.perf_counter() + DEFAULT_SETTLE_S
    while True:
        try:
            response = await client.get(f"{base}/v1/cache", headers=headers)
        except Exception:
            return None
        if response.status_code != 200:
            return None
        cache: dict[str, Any] = response.json()
        if cache.get("idle") or time.perf_counter() > deadline:
            return cache
        await asyncio.sleep(0.1)


def _arrivals(n: int, rate: float | None, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: a Poisson process, or all at 0."""
    if not rate:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
