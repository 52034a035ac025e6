"""`radixlm lint`: which requests of a file break which cached prefix, why, and the fix.

    radixlm lint requests.jsonl                  # the default model's tokenizer
    radixlm lint requests.jsonl --model DIR      # another model's tokenizer and chat template
    radixlm lint requests.jsonl --capacity 50000 --json

Each line is an OpenAI chat body ({"messages": ..., "tools": ..., "cache_salt": ...}); a
"response" field (the server's response or its message) is what the model answered, cached
after the prompt as the server would. The requests are replayed through a radix tree with the
tokenizer only (`PromptReplay`, no model): the reasons are the server's for the same inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from radixlm.observatory.explain import CacheReport
from radixlm.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help='a JSONL file of OpenAI chat bodies ("-" reads stdin)')
    parser.add_argument(
        "--model", default=None, help="a GGUF file or HF directory whose tokenizer to use"
    )
    parser.add_argument(
        "--capacity", type=int, default=None, help="tree tokens before LRU eviction (default: none)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON report per line")


def run(args: argparse.Namespace) -> int:
    from radixlm.model.loader import default_model_path

    tokenizer = Tokenizer.from_pretrained(args.model or default_model_path())
    stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
    with stream:
        bodies = [json.loads(line) for line in stream if line.strip()]
    reports = lint_bodies(bodies, tokenizer, args.capacity)
    for i, report in enumerate(reports):
        if args.json:
            print(json.dumps({"line": i + 1, **report.to_dict()}, ensure_ascii=False))
        elif report.reason not in ("hit", "new_content") or report.lost_tokens:
            print(describe(i + 1, report))
    if not args.json:
        print(summary(reports))
    return 0


def lint_bodies(
    bodies: Iterable[Mapping[str, Any]], tokenizer: Tokenizer, capacity: int | None = None
) -> list[CacheReport]:
    """One report per body, in order (what `radixlm lint` prints)."""
    from radixlm.observatory.replay import PromptReplay

    replay = PromptReplay(tokenizer, capacity)
    return [replay.request(body) for body in bodies]


def describe(line: int, report: CacheReport) -> str:
    where = report.segment or "the prompt"
    text = (
        f"line {line}: {report.reason} at token {report.cached_len} of {report.prompt_len} "
        f"({where}), {report.lost_tokens} tokens recomputed that could have been cached\n"
        f"    prompt: ...{report.before!r} | {report.after!r}...\n"
    )
    if report.tree_after is not None:
        text += f"    cached: ...{report.before!r} | {report.tree_after!r}...\n"
    if report.fix:
        text += f"    fix: {report.fix}"
    return text.rstrip("\n")


def summary(reports: list[CacheReport]) -> str:
    lost: dict[str, list[int]] = {}
    for r in reports:
        lost.setdefault(r.reason, []).append(r.lost_tokens)
    parts = [f"{reason} {len(v)} ({sum(v)} tokens lost)" for reason, v in sorted(lost.items())]
    prompt = sum(r.prompt_len for r in reports)
    cached = sum(r.cached_len for r in reports)
    return f"{len(reports)} requests, {cached}/{prompt} prompt tokens cached; " + ", ".join(parts)
