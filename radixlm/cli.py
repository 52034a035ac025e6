"""The `radixlm` command line: one subcommand per job, each living in the module that owns it.

A command module exposes `add_arguments(parser)` and `run(args) -> int`, and keeps its heavy
imports (torch, transformers) inside `run`, so building the parser stays fast and light.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("radixlm.commands.serve", "the OpenAI-compatible HTTP server"),
    "chat": ("radixlm.commands.chat", "a terminal chat that shows the prefix cache at work"),
    "generate": ("radixlm.commands.generate", "one prompt in, one completion out"),
    "demo": ("radixlm.demo", "replay a small chat scenario through the radix tree"),
    "lint": ("radixlm.commands.lint", "which requests of a file break the prefix cache, and why"),
}

# `radixlm bench <name>`
BENCHES: dict[str, tuple[str, str]] = {
    "serve": ("radixlm.bench.online", "load an OpenAI-compatible server with a workload"),
    "cache": ("radixlm.bench.cache_replay", "replay a request trace through the radix tree"),
    "model": ("radixlm.bench.model_speed", "prefill and decode speed against transformers"),
    "offline": ("radixlm.bench.offline", "a workload through the engine, radix cache vs none"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _load(module).add_arguments(sub)
    bench = commands.add_parser("bench", help="benchmarks that write JSON")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module, help_text) in BENCHES.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        _load(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(_load(args._module).run(args) or 0)


def _load(module: str) -> ModuleType:  # a command module: add_arguments(parser), run(args)
    return importlib.import_module(module)
