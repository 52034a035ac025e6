"""`radixlm chat`: a terminal chat with the model, the prefix cache at work in plain sight.

Each turn sends the whole conversation through the server's renderer (`PromptRenderer`, each
reply spliced back as the ids the model generated); the radix tree still holds the previous
turns (prompt and reply), so only the new message is prefilled. After each
reply a status line shows how many prompt tokens came from the cache and the time to first token.

    /reset  start a new conversation      /exit or Ctrl-D  quit      Ctrl-C  stop a reply
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from radixlm.commands.options import add_engine_arguments, add_sampling_arguments, engine_configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="a system prompt for the conversation")
    add_sampling_arguments(parser, max_tokens=512)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from radixlm.agents.prompt import PromptRenderer
    from radixlm.agents.turns import TurnMemo, turn_ids
    from radixlm.api_types import SamplingParams
    from radixlm.commands.local import load_engine, run_one
    from radixlm.commands.options import config_from_args

    try:
        configs = engine_configs(args)
        params = config_from_args(args, SamplingParams)
        engine = load_engine(configs)
    except ValueError as exc:
        print(f"radixlm chat: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    memo = TurnMemo()
    renderer = PromptRenderer(engine.tokenizer, memo)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("radixlm chat: /reset starts over, /exit quits, Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = renderer.prompt_ids(messages)
        except ValueError as exc:
            print(f"[{exc}]", file=sys.stderr)
            messages.pop()
            continue
        limit = min(engine.runner.max_context_len, engine.cache.capacity) - len(prompt)
        if limit < 1:
            print("[the conversation fills the context: /reset]", file=sys.stderr)
            messages.pop()
            continue
        turn = dataclasses.replace(params, max_tokens=min(params.max_tokens, limit))
        try:
            reply = run_one(engine, prompt, turn, on_text=_print)
        except KeyboardInterrupt:
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply.text})
        ids = turn_ids(engine.tokenizer, reply.text, reply.token_ids)
        if ids is not None:
            memo.remember(None, reply.text, (), ids)
        print(
            f"\n[{reply.cached_tokens}/{reply.prompt_tokens} prompt tokens from the cache · "
            f"TTFT {reply.ttft_s * 1000:.0f} ms · {len(reply.token_ids)} tokens at "
            f"{reply.decode_tok_s:.1f} tok/s · {reply.finish_reason}]",
            file=sys.stderr,
        )


def _print(text: str) -> None:
    print(text, end="", flush=True)
