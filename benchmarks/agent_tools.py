"""Agent loops through the server: does the prefix cache hold across every step?

    python benchmarks/agent_tools.py [--agents 8] [--steps 10] [--base-url URL]
                                     [--json docs/bench/agent_tools.json]

N agents run K steps each, concurrently, with the official openai client. Every step resends the
whole conversation (system prompt, tools, every earlier call and result) with
`tool_choice="required"`, so even a small model produces a call; the benchmark answers each call
with a generated tool result. Two runs, each in its own cache namespace (`cache_salt`): tools in
one fixed order, and tools shuffled per request (canonical rendering must make them the same).

Per step it records prompt tokens, `cached_tokens`, TTFT (streamed: the first delta), and where
the cached prefix ended against the end of the previous turn's output (prompt + completion of
step k-1, less its last token, whose KV no forward pass computed): `recomputed` tokens of
earlier turns are the ones the cache failed to keep.
Targets: from step 2 on, cached / prompt >= 0.9 on every step, and nothing recomputed.

Without --base-url the default model is served in this process (uvicorn on a free port).
`--overhead` adds the grammar figure: a decode step of 8 constrained requests against 8
unconstrained ones, in process (`agent_overhead.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agent_workload import SYSTEM_PROMPT, TASKS, TOOLS, tool_result
from openai import AsyncOpenAI

from radixlm.bench.host import describe_host


async def run_agent(
    client: AsyncOpenAI, model: str, agent: int, steps: int, shuffle: bool, salt: str
) -> list[dict[str, Any]]:
    rng = random.Random(agent)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASKS[agent % len(TASKS)].format(agent=agent)},
    ]
    rows: list[dict[str, Any]] = []
    previous_end = 0  # prompt + completion tokens of the previous step
    for step in range(1, steps + 1):
        tools = list(TOOLS)
        if shuffle:
            rng.shuffle(tools)
        start = time.perf_counter()
        ttft = None
        calls: dict[int, dict[str, str]] = {}
        usage = None
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="required",  # type: ignore[arg-type]
            parallel_tool_calls=False, temperature=0, max_tokens=96, stream=True,
            stream_options={"include_usage": True}, extra_body={"cache_salt": salt},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                for part in choice.delta.tool_calls or []:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["name"] += part.function.name or ""
                        call["arguments"] += part.function.arguments or ""
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        rows.append({
            "agent": agent, "step": step, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": cached, "completion_tokens": usage.completion_tokens,
            "cached_ratio": round(cached / usage.prompt_tokens, 4),
            "ttft_s": round(ttft if ttft is not None else time.perf_counter() - start, 4),
            "match_end": cached, "previous_end": previous_end,
            "recomputed": max(previous_end - cached, 0) if step > 1 else 0,
            "calls": [c["name"] for c in calls.values()],
        })  # fmt: skip
        row = rows[-1]
        progress = f"{row['cached_tokens']}/{row['prompt_tokens']} cached, TTFT {row['ttft_s']} s"
        print(f"[{salt[12:20]}] agent {agent} step {step}: {progress}", file=sys.stderr)
        # the KV computed so far: the prompt and every generated token but the last one, which
        # no forward pass has seen yet
        previous_end = usage.prompt_tokens + usage.completion_tokens - 1
        tool_calls = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]  # fmt: skip
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        for c in calls.values():
            result = tool_result(c["name"], c["arguments"], agent, step)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return rows


async def run_loops(base_url: str, agents: int, steps: int, shuffle: bool) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    salt = f"agent-bench-{'shuffled' if shuffle else 'ordered'}-{time.time_ns()}"
    start = time.perf_counter()
    per_agent = await asyncio.gather(
        *(run_agent(client, model, a, steps, shuffle, salt) for a in range(agents))
    )
    elapsed = time.perf_counter() - start
    await client.close()
    rows = sorted((r for agent_rows in per_agent for r in agent_rows),
                  key=lambda r: (r["step"], r["agent"]))  # fmt: skip
    return {"tools": "shuffled" if shuffle else "ordered", "elapsed_s": round(elapsed, 2),
            "steps": _per_step(rows, steps), "requests": rows,
            "targets": _targets(rows)}  # fmt: skip


def _per_step(rows: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    out = []
    for step in range(1, steps + 1):
        these = [r for r in rows if r["step"] == step]
        out.append({
            "step": step,
            "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in these), 1),
            "cached_tokens_mean": round(statistics.mean(r["cached_tokens"] for r in these), 1),
            "cached_ratio_min": min(r["cached_ratio"] for r in these),
            "ttft_s_p50": round(statistics.median(r["ttft_s"] for r in these), 4),
            "ttft_s_max": max(r["ttft_s"] for r in these),
            "recomputed_total": sum(r["recomputed"] for r in these),
        })  # fmt: skip
    return out


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["step"] >= 2]
    ratio = min((r["cached_ratio"] for r in later), default=1.0)
    recomputed = sum(r["recomputed"] for r in later)
    return {"min_cached_ratio_from_step_2": ratio, "ratio_target": 0.9,
            "recomputed_tokens_from_step_2": recomputed,
            "met": ratio >= 0.9 and recomputed == 0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--base-url", default=None, help="a running server's /v1 URL")
    parser.add_argument("--dtype", default="float32", help="in-process model dtype")
    parser.add_argument("--overhead", action="store_true", help="also the grammar overhead")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    result: dict[str, Any] = {"host": describe_host(), "agents": args.agents, "steps": args.steps}
    if args.base_url is None:
        from agent_workload import serve_default_model

        with serve_default_model(args.dtype) as url:
            result["model"] = "default (SmolLM2-135M-Instruct Q4_1), " + args.dtype
            result["runs"] = [asyncio.run(run_loops(url, args.agents, args.steps, s))
                              for s in (False, True)]  # fmt: skip
    else:
        result["runs"] = [asyncio.run(run_loops(args.base_url, args.agents, args.steps, s))
                          for s in (False, True)]  # fmt: skip
    if args.overhead:
        from agent_overhead import grammar_overhead

        result["grammar_overhead"] = grammar_overhead(args.dtype)
    for run in result["runs"]:
        print(f"tools {run['tools']}: {run['elapsed_s']} s, targets {run['targets']}")
        for s in run["steps"]:
            print("  ", json.dumps(s))
    if "grammar_overhead" in result:
        print("grammar overhead:", json.dumps(result["grammar_overhead"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
