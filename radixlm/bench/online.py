"""`radixlm bench serve`: load an OpenAI-compatible server with a workload, over HTTP.

    python -m radixlm bench serve --base-url http://127.0.0.1:8000 --workload multiturn \\
        --concurrency 64 [--rate R] [--disconnect-frac 0.2] [--json OUT]

Requests go out as streamed /v1/completions with token-id prompts, at most `concurrency` at once,
arriving as a Poisson process of `rate` per second (all at once without it). A request with a
parent waits for it and extends its actual output (multi-turn, tree of thought, agent loops).
A `--disconnect-frac` share of the requests hang up at a random token, as impatient clients do.

Reported: TTFT and inter-token latency p50/p99, throughput, errors by status (5xx counted apart),
cached prompt tokens (from `usage`) and the prefill an ideal cache would compute; when the server
is radixlm, also the prefill it did compute and its slot accounting once the load is gone
(`/v1/cache`): a leaked slot would show as in-flight slots left with no request running.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import time
from typing import Any

from radixlm.bench.workloads import WORKLOADS, Workload, WorkloadProgress, ideal_prefill_tokens

DEFAULT_SETTLE_S = 30.0  # how long the server gets to return every slot after the load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server, without /v1")
    parser.add_argument("--model", default=None, help="the model id (default: /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="multiturn")
    parser.add_argument(
        "--param", action="append", default=[], metavar="KEY=INT",
        help="a workload parameter, e.g. --param num_conversations=16 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--token-range", default="1000:30000", metavar="LO:HI",
        help="prompt token ids are drawn from [LO, HI): keep special tokens out",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (Poisson)")
    parser.add_argument(
        "--disconnect-frac", type=float, default=0.0, help="share of clients hanging up mid-way"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload, arrivals and disconnects")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early")
    parser.add_argument(
        "--extra-body", default="{}", metavar="JSON",
        help='fields added to every request body, e.g. \'{"verbose": true}\' for llama-server',
    )  # fmt: skip
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from radixlm.bench.online_stats import format_summary

    try:
        if args.concurrency < 1 or not 0.0 <= args.disconnect_frac <= 1.0:
            raise ValueError("--concurrency must be >= 1 and --disconnect-frac in [0, 1]")
        if not isinstance(json.loads(args.extra_body), dict):
            raise ValueError("--extra-body must be a JSON object")
        workload = workload_from_args(args)
    except ValueError as exc:
        print(f"radixlm bench serve: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(run_bench(args, workload))
    print(format_summary(result["summary"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload named by --workload with its --param values; ValueError names a bad one."""
    make = WORKLOADS[args.workload]
    accepted = set(inspect.signature(make).parameters) - {"token_range", "seed"}
    params: dict[str, int] = {}
    for item in args.param:
        key, _, value = item.partition("=")
        if key not in accepted or not value.lstrip("-").isdigit():
            raise ValueError(f"--param {item!r}: {args.workload} takes {sorted(accepted)}=INT")
        params[key] = int(value)
    lo, _, hi = args.token_range.partition(":")
    if not (lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        raise ValueError(f"--token-range must be LO:HI with LO < HI, got {args.token_range!r}")
    return make(token_range=range(int(lo), int(hi)), seed=args.seed, **params)


async def run_bench(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """Send the workload (children once their parent is done); return config, summary, cache."""
    import httpx

    from radixlm.bench.online_client import ClientOptions, RequestRecord, stream_completion
    from radixlm.bench.online_stats import percentiles, summarize

    base = args.base_url.rstrip("/").removesuffix("/v1")
    requests = workload.requests
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = args.model or await _served_model(client, base, args.api_key)
        options = ClientOptions(
            base,
            model,
            args.api_key,
            ignore_eos=not args.no_ignore_eos,
            extra_body=json.loads(args.extra_body),
        )
        rng = random.Random(args.seed)
        arrivals = _arrivals(len(requests), args.rate, rng)
        disconnects = [
            rng.randint(1, max(1, r.output_len - 1))
            if rng.random() < args.disconnect_frac
            else None
            for r in requests
        ]
        before = await _settled_cache(client, base, args.api_key)
        progress = WorkloadProgress(workload)
        done = [asyncio.Event() for _ in requests]
        records: list[RequestRecord | None] = [None] * len(requests)
        slots = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            parent = requests[i].parent
            if parent is not None:
                await done[parent].wait()
            prompt = progress.prompt(i)
            async with slots:
                record = await stream_completion(
                    client, options, str(i), prompt, requests[i].output_len, disconnects[i]
                )
            records[i] = record
            progress.finish(i, record.output_ids)
            done[i].set()

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
        cache = await _settled_cache(client, base, args.api_key)
    summary = summarize([r for r in records if r is not None], duration, cache)
    summary["ideal_prefill_tokens"] = ideal_prefill_tokens(progress.completed())
    if any(r.parent is not None for r in requests):  # multi-turn: first turns vs follow-ups
        for name, has_parent in (("root", False), ("followup", True)):
            ttft = [
                record.ttft_s
                for record, request in zip(records, requests)
                if record is not None
                and record.ttft_s is not None
                and (request.parent is not None) == has_parent
            ]
            summary.update(percentiles(f"{name}_ttft", ttft))
    if before is not None and cache is not None:  # radixlm: what the engine computed for it
        summary["server_prefill_tokens"] = (
            cache["engine_stats"]["prefill_tokens"] - before["engine_stats"]["prefill_tokens"]
        )
    config = {
        "base_url": base,
        "model": model,
        "workload": workload.name,
        "params": args.param,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "disconnect_frac": args.disconnect_frac,
        "seed": args.seed,
        "extra_body": args.extra_body,
        "num_requests": len(requests),
    }
    return {"config": config, "summary": summary, "server_cache": cache}


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
