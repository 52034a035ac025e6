"""The speculation benchmark's workloads and server: what each client sends, step by step.

    agent_tools   N agents x K steps of forced tool calls with JSON arguments (the agent
                  benchmark's system prompt, tools and tool results): calls repeat names, keys
                  and values the conversation holds
    code_edit     C agents x T steps editing a file they were shown: each reply is the whole
                  file again, with one change
    structured    R extraction requests under one JSON schema (response_format): keys forced by
                  the grammar, values copied from the request's text, the same shape every time
    random        R prompts of random token ids, sampled at temperature 1: nothing to copy

Every client runs concurrently through the OpenAI API and returns one record per request: its
completion tokens, what it produced (compared across speculation modes) and the usage's
`speculation` counts.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agent_workload import SYSTEM_PROMPT, TASKS, TOOLS, tool_result
from openai import AsyncOpenAI

from radixlm.bench.online_replicas import wait_until_healthy

Record = dict[str, Any]

CODE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file; missing keys take their defaults."""
    defaults = {"host": "127.0.0.1", "port": 8000, "workers": 2, "debug": False}
    data = json.loads(Path(path).read_text())
    return {key: data.get(key, value) for key, value in defaults.items()}


def address(settings):
    return f"{settings['host']}:{settings['port']}"


def worker_count(settings, cpus):
    if settings["workers"] <= 0:
        return cpus
    return min(settings["workers"], cpus)
'''
EDITS = [
    "Rename the function address to bind_address.",
    "Change the default port to 8080.",
    "Make worker_count return at least 1.",
    "Add a docstring to worker_count.",
]
CODE_SYSTEM = (
    "You are a careful coding assistant. When asked to change a file, reply with the complete "
    "changed file in one python code block and nothing else."
)
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 20},
        "company": {"type": "string", "maxLength": 30},
        "role": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "email", "city", "company", "role"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Ada Moreau", "Lyon", "Kestrel Labs", "data engineer"),
    ("Bram Visser", "Utrecht", "Northwind", "site reliability lead"),
    ("Chen Wei", "Suzhou", "Lanternfish", "product manager"),
    ("Dina Haddad", "Amman", "Cedar Systems", "security analyst"),
    ("Emil Novak", "Brno", "Quarry AI", "research scientist"),
    ("Farah Khan", "Lahore", "Monsoon Cloud", "backend developer"),
    ("Gus Olsen", "Bergen", "Fjordline", "support manager"),
    ("Hana Sato", "Sendai", "Kitsune Works", "designer"),
]


def record_text(i: int) -> str:
    name, city, company, role = PEOPLE[i % len(PEOPLE)]
    email = name.lower().replace(" ", ".") + f"{i}@{company.lower().split()[0]}.example"
    return (
        f"Extract the contact record. Message {i}: hello, this is {name}, {role} at {company}, "
        f"writing from {city}. You can reach me at {email} any weekday."
    )


async def agent_tools(client: AsyncOpenAI, model: str, salt: str, agents: int, steps: int
                      ) -> list[Record]:  # fmt: skip
    async def one(agent: int) -> list[Record]:
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": TASKS[agent % len(TASKS)].format(agent=agent)},
        ]
        records = []
        for step in range(1, steps + 1):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                parallel_tool_calls=False, temperature=0, max_tokens=96,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
            message = response.choices[0].message
            calls = [(c.id, c.function.name, c.function.arguments)
                     for c in message.tool_calls or []]  # fmt: skip
            made = [(n, a) for _, n, a in calls]  # ids are random: compared without them
            records.append(_record(response, f"agent {agent} step {step}", made))
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls]})  # fmt: skip
            for i, n, a in calls:
                messages.append({"role": "tool", "tool_call_id": i,
                                 "content": tool_result(n, a, agent, step)})  # fmt: skip
        return records

    return [r for rs in await asyncio.gather(*(one(a) for a in range(agents))) for r in rs]


async def code_edit(client: AsyncOpenAI, model: str, salt: str, agents: int, steps: int
                    ) -> list[Record]:  # fmt: skip
    async def one(agent: int) -> list[Record]:
        code = CODE.replace("8000", str(8000 + agent))
        messages: list[Any] = [{"role": "system", "content": CODE_SYSTEM}]
        records = []
        for step in range(steps):
            edit = EDITS[(agent + step) % len(EDITS)]
            shown = f"Here is settings.py:\n```python\n{code}```\n" if step == 0 else ""
            ask = f"{shown}{edit} Reply with the whole file."
            messages.append({"role": "user", "content": ask})
            response = await client.chat.completions.create(
                model=model, messages=messages, temperature=0, max_tokens=320,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
            text = response.choices[0].message.content or ""
            records.append(_record(response, f"agent {agent} step {step}", text))
            messages.append({"role": "assistant", "content": text})
        return records

    return [r for rs in await asyncio.gather(*(one(a) for a in range(agents))) for r in rs]


async def structured(client: AsyncOpenAI, model: str, salt: str, requests: int) -> list[Record]:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "contact", "schema": RECORD_SCHEMA, "strict": True},
    }

    async def one(i: int) -> Record:
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": record_text(i)}],
            response_format=response_format, temperature=0, max_tokens=128,  # type: ignore[arg-type]
            extra_body={"cache_salt": salt},
        )  # fmt: skip
        return _record(response, f"record {i}", response.choices[0].message.content)

    return list(await asyncio.gather(*(one(i) for i in range(requests))))


async def random_tokens(client: AsyncOpenAI, model: str, salt: str, requests: int,
                        vocab: int = 49152) -> list[Record]:  # fmt: skip
    async def one(i: int) -> Record:
        rng = random.Random(i)
        prompt = [rng.randrange(100, vocab) for _ in range(256)]
        response = await client.completions.create(
            model=model, prompt=prompt, temperature=1.0, seed=i, max_tokens=64,
            extra_body={"cache_salt": salt, "ignore_eos": True},
        )  # fmt: skip
        return _record(response, f"random {i}", response.choices[0].text)

    return list(await asyncio.gather(*(one(i) for i in range(requests))))


def _record(response: Any, name: str, output: Any) -> Record:
    usage = response.usage
    spec = (usage.model_extra or {}).get("speculation") or {}
    return {
        "name": name,
        "completion_tokens": usage.completion_tokens,
        "drafted_tokens": spec.get("drafted_tokens", 0),
        "accepted_tokens": spec.get("accepted_tokens", 0),
        "output": json.dumps(output, sort_keys=True),
    }


@contextmanager
def serve(speculate: str, dtype: str, threads: int) -> Iterator[str]:
    """`radixlm serve` (the default model) with `--speculate` in a child process of its own:
    each run starts from a fresh process, and nothing one run allocates stays for the next;
    yields the /v1 base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    flags = {"--port": str(port), "--dtype": dtype, "--num-threads": str(threads),
             "--speculate": speculate, "--log-level": "warning"}  # fmt: skip
    command = [sys.executable, "-m", "radixlm", "serve", *(x for f in flags.items() for x in f)]
    child = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(child, url, 600)
        yield url + "/v1"
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
