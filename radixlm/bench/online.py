"""`radixlm bench serve`: load an OpenAI-compatible server with a workload, over HTTP.

    python -m radixlm bench serve --base-url http://127.0.0.1:8000 --workload multiturn \\
        --concurrency 64 [--rate R] [--disconnect-frac 0.2] [--prompt-format tokens|text|chat] \\
        [--stream all|none|one-per-group] [--server-url URL ...] [--timeline] [--json OUT]

Requests go out as /v1/completions with token-id prompts, or as text or chat (`online_prompts`;
gateways such as smg route on text and reject token ids), streamed unless told otherwise, at
most `concurrency` at once, arriving as a Poisson process of `rate` per second (all at once
without it). A request with a parent waits for it and extends its actual output (multi-turn,
tree of thought, agent loops). A `--disconnect-frac` share of the streamed requests hang up at a
random token, as impatient clients do.

Reported: TTFT and inter-token latency p50/p99, throughput, errors by status (5xx counted apart),
cached prompt tokens (from `usage`) and the prefill an ideal cache would compute; which replica
served each request when the responses say (and so each prefix group's affinity); when the
servers are radixlm (`--server-url`, one per replica behind a gateway; default the base URL),
the prefill they computed and their slot accounting once the load is gone (`/v1/cache`): a
leaked slot would show as in-flight slots left with no request running. Against one radixlm
server, the served efficiency too: the share of the run's wall time its engine spent in forward
passes. `--timeline` asks radixlm for each request's timeline (`return_timeline`) and reports
every stage's p50 / p99 (first turns and follow-ups apart). `--workload followup` is the
follow-up benchmark: long conversations, each next turn a few new tokens over its whole history
cached; run it with `--concurrency 1` (one stream) and 8.
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

import numpy as np

from radixlm.bench.online_prompts import PROMPT_FORMATS, PromptBook
from radixlm.bench.workloads import WORKLOADS, CompletedRequest, Workload, ideal_prefill_tokens

DEFAULT_SETTLE_S = 30.0  # how long the server gets to return every slot after the load
STREAM_CHOICES = ("all", "none", "one-per-group")


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
    parser.add_argument(
        "--prompt-format", choices=PROMPT_FORMATS, default="tokens",
        help="token ids or text to /v1/completions, or messages to /v1/chat/completions",
    )  # fmt: skip
    parser.add_argument(
        "--stream", choices=STREAM_CHOICES, default="all",
        help="stream every request, none, or only the last of each prefix group",
    )  # fmt: skip
    parser.add_argument(
        "--server-url", action="append", default=[], metavar="URL",
        help="a radixlm server whose /v1/cache is read before and after; repeat for each "
        "replica behind a gateway (default: --base-url)",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (Poisson)")
    parser.add_argument(
        "--disconnect-frac", type=float, default=0.0, help="share of clients hanging up mid-way"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload, arrivals and disconnects")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--extra-body", default="{}", metavar="JSON",
        help='fields added to every request body, e.g. \'{"verbose": true}\' for llama-server',
    )  # fmt: skip
    parser.add_argument(
        "--timeline", action="store_true",
        help="ask radixlm for each request's timeline (return_timeline) and report its stages",
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
        from radixlm.bench.host import describe_host  # the client's host, beside the figures

        with open(args.json, "w") as f:
            json.dump({**result, "host": describe_host()}, f, indent=2)
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
    """Send the workload (children once their parent is done); return config, summary, the
    servers' caches and one row per request."""
    import httpx

    from radixlm.bench.online_client import ClientOptions, RequestRecord, stream_completion
    from radixlm.bench.online_stats import (
        merged_accounting,
        percentiles,
        replica_summary,
        served_efficiency,
        server_rows,
        summarize,
        timeline_summary,
    )

    base = args.base_url.rstrip("/").removesuffix("/v1")
    servers = [u.rstrip("/").removesuffix("/v1") for u in args.server_url] or [base]
    requests = workload.requests
    book = PromptBook(workload, args.prompt_format)
    streamed = _streamed(book.group, args.stream)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model or await _served_model(client, base, args.api_key)
        options = ClientOptions(
            base,
            model,
            args.api_key,
            ignore_eos=not args.no_ignore_eos,
            return_timeline=args.timeline,
            extra_body=json.loads(args.extra_body),
        )
        rng = random.Random(args.seed)
        arrivals = _arrivals(len(requests), args.rate, rng)
        disconnects = [
            rng.randint(1, max(1, r.output_len - 1))
            if rng.random() < args.disconnect_frac and streamed[i]
            else None
            for i, r in enumerate(requests)
        ]
        before = await _settled_caches(client, servers, args.api_key)
        done = [asyncio.Event() for _ in requests]
        records: list[RequestRecord | None] = [None] * len(requests)
        slots = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            parent = requests[i].parent
            if parent is not None:
                await done[parent].wait()
            prompt = book.prompt(i)
            async with slots:
                record = await stream_completion(
                    client, options, str(i), prompt, requests[i].output_len, disconnects[i],
                    stream=streamed[i],
                )  # fmt: skip
            records[i] = record
            book.finish(i, record.output_text, record.output_ids)
            done[i].set()

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
        after = await _settled_caches(client, servers, args.api_key)
    finished = [r for r in records if r is not None]
    summary = summarize(finished, duration, merged_accounting(after))
    summary["ideal_prefill_tokens"] = _ideal_prefill(book, finished)
    rows = [_row(i, book.group[i], r) for i, r in enumerate(records) if r is not None]
    summary.update(replica_summary(rows))
    summary["timeline"] = timeline_summary(finished)
    if any(r.parent is not None for r in requests):  # multi-turn: first turns vs follow-ups
        for name, has_parent in (("root", False), ("followup", True)):
            turn = [
                record
                for record, request in zip(records, requests)
                if record is not None and (request.parent is not None) == has_parent
            ]
            ttft = [r.ttft_s for r in turn if r.ttft_s is not None]
            summary.update(percentiles(f"{name}_ttft", ttft))
            summary[f"{name}_timeline"] = timeline_summary(turn)
            summary.update(_turn_tokens(name, turn))
    summary["servers"] = server_rows(before, after)
    if summary["servers"] and all(s["prefill_tokens"] is not None for s in summary["servers"]):
        summary["server_prefill_tokens"] = sum(s["prefill_tokens"] for s in summary["servers"])
    summary.update(served_efficiency(summary["servers"], duration) or {})
    config = {
        "base_url": base,
        "server_urls": servers,
        "model": model,
        "workload": workload.name,
        "params": args.param,
        "prompt_format": args.prompt_format,
        "stream": args.stream,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "disconnect_frac": args.disconnect_frac,
        "seed": args.seed,
        "extra_body": args.extra_body,
        "timeline": args.timeline,
        "num_requests": len(requests),
    }
    return {"config": config, "summary": summary, "server_cache": after.get(servers[0]),
            "server_caches": after, "requests": rows}  # fmt: skip


# ---- helpers --------------------------------------------------------------------------------
def _streamed(group: list[int], mode: str) -> list[bool]:
    """Which requests stream: all, none, or the last request of each group."""
    if mode != "one-per-group":
        return [mode == "all"] * len(group)
    last = {g: i for i, g in enumerate(group)}
    return [last[g] == i for i, g in enumerate(group)]


def _turn_tokens(name: str, records: list[Any]) -> dict[str, float]:
    """The median cached and new (uncached) prompt tokens of these requests, as the server
    reported them."""
    known = [r for r in records if r.ok and r.cached_tokens is not None]
    if not known:
        return {}
    return {
        f"{name}_cached_tokens_p50": float(np.median([r.cached_tokens for r in known])),
        f"{name}_new_tokens_p50": float(np.median([r.prompt_len - r.cached_tokens for r in known])),
    }


def _ideal_prefill(book: PromptBook, records: list[Any]) -> int | None:
    """The ideal prefill in the server's tokens: from the workload's ids (tokens format), else
    from the ids the server returned (None when it returned none)."""
    if book.format == "tokens":
        return ideal_prefill_tokens(book.progress.completed())
    completed = [CompletedRequest(r.prompt_ids, r.output_ids) for r in records if r.prompt_ids]
    return ideal_prefill_tokens(completed) if len(completed) == len(records) else None


def _row(index: int, group: int, r: Any) -> dict[str, Any]:
    return {
        "index": index, "group": group, "worker": r.worker, "status": r.status,
        "error": r.error, "streamed": r.streamed, "usage_then_done": r.usage_then_done,
        "prompt_tokens": r.prompt_len, "cached_tokens": r.cached_tokens,
        "output_tokens": r.num_output_tokens, "latency_s": r.latency_s,
    }  # fmt: skip


async def _served_model(client: Any, base: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = await client.get(f"{base}/v1/models", headers=headers)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _settled_caches(
    client: Any, urls: list[str], api_key: str | None
) -> dict[str, dict[str, Any] | None]:
    caches = await asyncio.gather(*(_settled_cache(client, u, api_key) for u in urls))
    return dict(zip(urls, caches))


async def _settled_cache(client: Any, base: str, api_key: str | None) -> dict[str, Any] | None:
    """radixlm's /v1/cache once no request is left (aborts land asynchronously); None when the
    server has no such route or does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.perf_counter() + DEFAULT_SETTLE_S
    while True:
        try:
            response = await client.get(f"{base}/v1/cache", headers=headers, timeout=10.0)
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
