"""The agent benchmark's workload: a system prompt, six tools, tasks, tool results, a server.

The tools' schemas are bounded (enums, integer ranges, short strings) so a forced call always
ends within the step's token budget, whatever a small model samples.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SYSTEM_PROMPT = (
    "You are an operations assistant for a small engineering team. You work in steps: at each "
    "step you call exactly one tool, read its result, and decide the next call. Rules:\n"
    "1. Prefer reading documentation and files before acting; never guess a value a tool can "
    "look up.\n2. Keep arguments minimal and exact; use the enumerations the tools define.\n"
    "3. When a tool fails, try another approach rather than repeating the same call.\n"
    "4. Dates are in ISO format (YYYY-MM-DD). Temperatures are in degrees Celsius.\n"
    "5. Emails go only to the addresses the send_email tool lists; subjects are short.\n"
    "6. Arithmetic is done with the add tool, never in your head.\n"
    "7. Summaries are written for a busy reader: facts first, no filler, no speculation.\n"
    "8. You may be interrupted at any step; the conversation so far is your only memory.\n"
    "Background: the team runs a web service in three regions (Paris, Oslo, Lima), deploys "
    "every weekday, and keeps its runbooks in the docs folder. On-call questions usually need "
    "the weather (for the data-centre cooling report), a calendar check, and a short email."
)

TASKS = [
    "Agent {agent}: prepare the cooling report for Paris and email it to ops.",
    "Agent {agent}: check whether Oslo's deploy window on 2026-12-14 is free and tell the lead.",
    "Agent {agent}: add up this week's incident counts and file them in the runbook.",
    "Agent {agent}: read the Lima runbook and summarise its failover steps for on-call.",
]


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": sorted(properties), "additionalProperties": False},
            "strict": True,
        },
    }  # fmt: skip


CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
TOOLS = [
    _tool("get_weather", "Current weather in one of the team's regions.", {"city": CITY}),
    _tool("add", "Add two integers.", {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                       "b": {"type": "integer", "minimum": -999, "maximum": 999}}),
    _tool("read_file", "Read a file from the docs folder.", {"path": {"type": "string", "enum": [
        "docs/paris.md", "docs/oslo.md", "docs/lima.md", "docs/oncall.md"]}}),
    _tool("search_docs", "Full-text search over the runbooks.",
          {"query": {"type": "string", "maxLength": 24, "pattern": "^[a-z ]+$"}}),
    _tool("calendar_lookup", "Events on a day.",
          {"date": {"type": "string", "pattern": "^2026-12-[0-2][0-9]$"}}),
    _tool("send_email", "Send a short email.", {
        "to": {"type": "string", "enum": ["ops@example.com", "lead@example.com"]},
        "subject": {"type": "string", "maxLength": 24, "pattern": "^[A-Za-z ]+$"}}),
]  # fmt: skip


def tool_result(name: str, arguments: str, agent: int, step: int) -> str:
    """A deterministic observation of 40-60 tokens, different per agent and step."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        args = {}
    return json.dumps({
        "tool": name, "agent": agent, "step": step, "ok": True, "arguments": args,
        "result": f"{name} finished for agent {agent} at step {step}; 3 items matched, "
                  f"the newest from 2026-12-{10 + step:02d}; nothing else changed.",
    })  # fmt: skip


@contextmanager
def serve_default_model(dtype: str = "float32") -> Iterator[str]:
    """The default model served in this process; yields the /v1 base URL."""
    import uvicorn

    from radixlm.config import ModelConfig, ServerConfig
    from radixlm.engine.async_engine import AsyncEngine
    from radixlm.engine.engine import Engine
    from radixlm.server.app import create_app

    engine = AsyncEngine(lambda: Engine(ModelConfig(dtype=dtype)))  # type: ignore[arg-type]
    engine.start()
    app = create_app(engine, ServerConfig())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
        sock.close()
