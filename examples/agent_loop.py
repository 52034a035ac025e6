"""An agent loop against `radixlm serve` with the official openai client.

    python -m radixlm serve &                 # the default model on http://127.0.0.1:8000
    python examples/agent_loop.py [--base-url http://127.0.0.1:8000/v1] [--steps 3]

Each step resends the whole conversation (system prompt, tools, every earlier call and result),
as agents do. The model is forced to call a tool (`tool_choice="required"`: a small model rarely
decides to on its own), the script runs the call locally and appends the result; a last request
with `tool_choice="none"` asks for the answer. Each line shows how much of the prompt the server's
prefix cache already held: from the second step on, everything but the newest tool result.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
]


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    """The tools, run locally: the server only proposes calls."""
    if name == "get_weather":
        temperature = {"Paris": 18, "Oslo": 7, "Lima": 24}.get(arguments.get("city", ""), 20)
        return json.dumps({"city": arguments.get("city"), "celsius": temperature})
    if name == "add":
        return json.dumps({"sum": int(arguments.get("a", 0)) + int(arguments.get("b", 0))})
    return json.dumps({"error": f"no tool named {name}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--steps", type=int, default=3, help="forced tool calls before answering")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful assistant. Use the tools."},
        {"role": "user", "content": "How warm is it in Oslo and in Lima, and what is 7 + 35?"},
    ]
    for step in range(1, args.steps + 2):
        final = step > args.steps
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="none" if final else "required",
            temperature=0,
            max_tokens=128,
        )
        choice = response.choices[0]
        usage = response.usage
        details = usage.prompt_tokens_details if usage else None
        cached, prompt = (
            (details.cached_tokens or 0) if details else 0,
            usage.prompt_tokens if usage else 0,
        )
        print(
            f"step {step}: prompt {prompt} tokens, {cached} cached ({cached / max(prompt, 1):.0%})"
        )
        messages.append(choice.message.model_dump(exclude_none=True))  # send back what we got
        if final or not choice.message.tool_calls:
            print("answer:", choice.message.content)
            return
        for call in choice.message.tool_calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
