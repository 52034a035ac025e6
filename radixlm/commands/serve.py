"""`radixlm serve`: the OpenAI-compatible server on one engine.

    radixlm serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY ...]
                  [--salt-from api-key|header:NAME|none] [--report-cached-tokens exact|page|none]
                  [engine options]

Loads the model (with a progress display), starts the engine thread, prints the URL and a curl
example, and serves with uvicorn until Ctrl-C; then open streams get a few seconds to finish,
whatever still runs is aborted, and the engine thread stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from radixlm.commands.options import (
    add_engine_arguments,
    add_server_arguments,
    engine_configs,
    server_config,
)
from radixlm.config import ServerConfig

if TYPE_CHECKING:
    from radixlm.server.state import ServerState


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def run(args: argparse.Namespace) -> int:
    from radixlm.commands.local import load_engine
    from radixlm.engine.async_engine import AsyncEngine
    from radixlm.server.app import create_app
    from radixlm.server.connections import header_timeout_protocol

    try:
        configs = engine_configs(args)
        config = server_config(args)
    except ValueError as exc:
        print(f"radixlm serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    async_engine = AsyncEngine(lambda: load_engine(configs))  # loads on the engine thread
    try:
        async_engine.start()
    except KeyboardInterrupt:
        print("\ninterrupted while loading", file=sys.stderr)
        return 130
    try:
        app = create_app(async_engine, config)
        server = _Server(
            app.state.radixlm,
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                http=header_timeout_protocol(config.header_timeout_s),
                log_level=args.log_level,
                timeout_graceful_shutdown=int(config.graceful_shutdown_s),
            ),
        )
        print(_banner(config, app.state.radixlm.model_name), flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
            server.run()
    finally:
        async_engine.shutdown()
    print("radixlm serve: stopped", file=sys.stderr)
    return 0


class _Server(uvicorn.Server):
    """uvicorn that aborts every running request on Ctrl-C, so open streams end at once (with
    an error event) instead of holding the shutdown until they finish or time out."""

    def __init__(self, state: ServerState, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.radixlm_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.radixlm_state.abort_all()


def _banner(config: ServerConfig, model: str) -> str:
    """The URL and a curl example. Never a key: terminals and logs are read by others."""
    url = f"http://{config.host}:{config.port}"
    auth = ' \\\n  -H "Authorization: Bearer $RADIXLM_API_KEY"' if config.api_keys else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}'
    )
    return (
        f"\nradixlm serving {model} at {url}  (OpenAI API under {url}/v1; Ctrl-C stops)\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"  -d '{body}'\n"
    )
