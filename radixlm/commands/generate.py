"""`radixlm generate`: one prompt in, one completion out.

    radixlm generate "The capital of France is" --max-tokens 16 --temperature 0
    radixlm generate --chat "Write a haiku about caches" --json

The text streams to stdout as it is decoded; `--json` prints one JSON object instead (text, token
ids, prompt and cached token counts, finish reason, TTFT). A prompt of "-" is read from stdin.
"""

from __future__ import annotations

import argparse
import json
import sys

from radixlm.commands.options import add_engine_arguments, add_sampling_arguments, engine_configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='the prompt text ("-" reads stdin)')
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object, not the text")
    add_sampling_arguments(parser, max_tokens=128)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from radixlm.agents.prompt import PromptRenderer
    from radixlm.api_types import SamplingParams
    from radixlm.commands.local import load_engine, run_one
    from radixlm.commands.options import config_from_args

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        configs = engine_configs(args)
        params = config_from_args(args, SamplingParams)
        engine = load_engine(configs)
        if args.chat:
            messages = [{"role": "user", "content": text}]
            prompt = PromptRenderer(engine.tokenizer).prompt_ids(messages)
        else:
            prompt = engine.tokenizer.encode(text)
        reply = run_one(engine, prompt, params, on_text=None if args.json else _print)
    except ValueError as exc:
        print(f"radixlm generate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        out = {
            "text": reply.text,
            "token_ids": reply.token_ids,
            "prompt_token_ids": list(prompt),
            "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": reply.cached_tokens,
            "finish_reason": reply.finish_reason,
            "ttft_s": round(reply.ttft_s, 6),
            "total_s": round(reply.total_s, 6),
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
    return 0


def _print(text: str) -> None:
    print(text, end="", flush=True)
