"""Agent rules through the server, as the frameworks meet them: non-strict tools forced into
their declared properties, an output cut by max_tokens reported as "length" and never as a
call, the response format as the text branch under auto, allowed_tools, the SDK's parse()
message resent as is, and a turn resent reformatted still served from the cache.

The tiny random model cannot decide to call a tool, so calls are forced (or the grammar leaves
only calls and JSON); the `client` fixture checks the slot accounting after every test.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from live_server import LiveServer
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel

pytestmark = pytest.mark.timeout(180)

LOOKUP: dict[str, Any] = {  # a non-strict schema, as LangChain's bind_tools sends it
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["city"],
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"],
        },
    },
}  # fmt: skip
FORECAST = {
    "type": "json_schema",
    "json_schema": {
        "name": "forecast",
        "schema": {
            "type": "object",
            "properties": {"rain": {"type": "boolean"}},
            "required": ["rain"],
            "additionalProperties": False,
        },
    },
}
USER: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Weather in Oslo, and 2 + 3?"}
]


class Forecast(BaseModel):
    rain: bool


@pytest.fixture(scope="module")
def server_context_len() -> int:
    return 4096


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "messages": USER, "temperature": 0, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(**kwargs)


def _computed(usage: Any) -> int:
    """What a request left computed in the tree: its prompt and every output token but the
    last, whose KV no forward pass has made yet."""
    return int(usage.prompt_tokens + usage.completion_tokens - 1)


def test_forced_non_strict_calls_hold_only_declared_properties(client: openai.OpenAI) -> None:
    response = _chat(client, tools=[LOOKUP, ADD], tool_choice="required")
    calls = response.choices[0].message.tool_calls
    assert calls and response.choices[0].finish_reason == "tool_calls"
    for call in calls:
        declared = list(({"lookup": LOOKUP, "add": ADD}[call.function.name])["function"][
            "parameters"]["properties"])  # fmt: skip
        keys = list(json.loads(call.function.arguments))
        assert keys == [k for k in declared if k in keys]  # declared, once each, in order


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["arguments", "closing tag"])
def test_a_call_cut_by_max_tokens_is_length_and_no_call(
    client: openai.OpenAI, stream: bool, where: str
) -> None:
    kwargs = {"tools": [LOOKUP], "tool_choice": "required", "parallel_tool_calls": False}
    whole = _chat(client, **kwargs)  # one token per byte: the call's length in tokens
    text = whole.choices[0].message.tool_calls[0].function.arguments
    length = whole.usage.completion_tokens - 1  # its end of sequence aside
    # cut inside the arguments (the header was sent), or after them, before the closing tag
    kwargs["max_tokens"] = length - len(text) // 2 if where == "arguments" else length - 13
    if not stream:
        choice = _chat(client, **kwargs).choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert (choice.message.content or "").startswith("<tool_call>")
        return
    finish, content = None, ""
    for chunk in _chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert not delta.tool_calls  # no half call is ever sent
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and content.startswith("<tool_call>")


@pytest.mark.parametrize("strict", [False, True])
def test_auto_with_a_response_format_answers_in_the_format_or_calls(
    client: openai.OpenAI, strict: bool
) -> None:
    tool = {"type": "function", "function": {**LOOKUP["function"], "strict": strict}}
    for seed in range(3):
        response = _chat(client, tools=[tool], tool_choice="auto", response_format=FORECAST,
                         temperature=1.0, seed=seed)  # fmt: skip
        message = response.choices[0].message
        if message.tool_calls:
            assert response.choices[0].finish_reason == "tool_calls"
        else:
            assert set(json.loads(message.content or "")) == {"rain"}


def test_allowed_tools_narrow_the_forced_call(client: openai.OpenAI) -> None:
    allowed = [{"type": "function", "function": {"name": "add"}}]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": allowed}}
    response = _chat(client, tools=[LOOKUP, ADD], tool_choice=choice)
    calls = response.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"add"}


def test_a_parsed_message_goes_back_as_the_sdk_returns_it(client: openai.OpenAI) -> None:
    first = client.chat.completions.parse(
        model="tiny", messages=USER, response_format=Forecast, temperature=0, max_tokens=60
    )
    message = first.choices[0].message
    assert isinstance(message.parsed, Forecast)
    again = [*USER, message, {"role": "user", "content": "and tomorrow?"}]
    second = _chat(client, messages=again, max_tokens=2)  # `parsed` and `refusal` ride along
    assert second.usage.prompt_tokens_details.cached_tokens == _computed(first.usage)


@pytest.mark.parametrize("style", ["compact", "reordered"])
def test_a_turn_resent_reformatted_is_served_from_the_cache(
    client: openai.OpenAI, style: str
) -> None:
    """A framework re-serializes the call's arguments (pydantic-ai compacts them); compared
    as JSON, the turn is the one generated, and its ids are spliced back."""
    user = [{"role": "user", "content": f"Add two numbers ({style})"}]
    first = _chat(client, messages=user, tools=[ADD], tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    [call] = first.choices[0].message.tool_calls
    value = json.loads(call.function.arguments)
    if style == "compact":
        arguments = json.dumps(value, separators=(",", ":"))
    else:
        arguments = json.dumps(dict(reversed(list(value.items()))))
    assert arguments != call.function.arguments
    function = {"name": "add", "arguments": arguments}
    calls = [{"id": call.id, "type": "function", "function": function}]
    resent = {"role": "assistant", "content": None, "tool_calls": calls}
    result = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    second = _chat(client, messages=[*user, resent, result], tools=[ADD], max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens == _computed(first.usage)


def test_a_different_value_is_not_spliced(client: openai.OpenAI, server: LiveServer) -> None:
    user = [{"role": "user", "content": "Add two other numbers"}]
    first = _chat(client, messages=user, tools=[ADD], tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    [call] = first.choices[0].message.tool_calls
    value = json.loads(call.function.arguments)
    function = {"name": "add", "arguments": json.dumps({**value, "a": (value["a"] + 1) % 10})}
    calls = [{"id": call.id, "type": "function", "function": function}]
    resent = {"role": "assistant", "content": None, "tool_calls": calls}
    body = {"model": "tiny", "messages": [*user, resent], "tools": [ADD], "max_tokens": 1,
            "return_cache_report": True}  # fmt: skip
    report = server.post("/v1/chat/completions", json=body).json()["cache_report"]
    assert report["reason"] == "different_previous_turn"
    assert report["cached_len"] < _computed(first.usage)
