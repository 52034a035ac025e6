"""Tools, structured outputs and logit_bias through the server, with the official openai client.

The tiny random model cannot decide to call a tool, so calls are forced (`tool_choice` required
or named): the grammar makes whatever it samples a valid call. What is checked is the contract:
calls parse into `message.tool_calls`, streamed deltas reassemble into the same calls, a resent
turn is served from the cache through its last token, and every bad input is a 400 after which
the server still serves with its slot accounting back at idle (the `client` fixture checks).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from live_server import LiveServer
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(180)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
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
            "additionalProperties": False,
        },
    },
}  # fmt: skip
USER: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"}
]


@pytest.fixture(scope="module")
def server_context_len() -> int:
    """Room for tool schemas and long forced calls."""
    return 4096


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "messages": USER, "temperature": 0, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_required_call_round_trip_hits_the_cache_through_the_returned_turn(
    client: openai.OpenAI,
) -> None:
    first = _chat(client, tools=[WEATHER, ADD], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" for c in calls)
    assert {c.function.name for c in calls} <= {"get_weather", "add"}
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'} for c in calls]
    conversation = [*USER, choice.message.model_dump(exclude_none=True), *results]
    second = _chat(client, messages=conversation, tools=[ADD, WEATHER], tool_choice="auto")
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    usage1, usage2 = first.usage, second.usage
    assert usage1 is not None and usage2 is not None and usage2.prompt_tokens_details is not None
    # everything the first turn computed was reused: its prompt and every generated token but
    # the last (the end of turn), whose KV no forward pass has computed yet
    assert usage2.prompt_tokens_details.cached_tokens == (
        usage1.prompt_tokens + usage1.completion_tokens - 1
    )


def test_named_tool_and_parallel_calls(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    for parallel in (True, False):
        response = _chat(client, tools=[WEATHER, ADD], tool_choice=named,
                         parallel_tool_calls=parallel, max_tokens=300)  # fmt: skip
        calls = response.choices[0].message.tool_calls
        assert calls and {c.function.name for c in calls} == {"add"}
        if not parallel:
            assert len(calls) == 1
        assert len({c.id for c in calls}) == len(calls)


def test_streamed_calls_reassemble_into_the_same_calls(client: openai.OpenAI) -> None:
    kwargs = {"tools": [WEATHER, ADD], "tool_choice": "required", "max_tokens": 300}
    whole = _chat(client, **kwargs).choices[0].message.tool_calls
    stream = _chat(client, stream=True, **kwargs)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            assert isinstance(part.index, int)
            if part.function and part.function.name is not None:
                assert part.index not in calls and part.id  # the name once, with the id
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += (part.function and part.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole or []
    ]


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    rain: bool
    celsius: int = Field(ge=-9, le=9)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model="tiny", messages=USER, response_format=Forecast, temperature=0, max_tokens=100
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast)


def test_json_object_and_n_samples(client: openai.OpenAI) -> None:
    response = _chat(client, response_format={"type": "json_object"}, n=2, temperature=1.0,
                     seed=3, max_tokens=400)  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
        else:  # cut by max_tokens: still the start of an object
            assert (choice.message.content or "").startswith("{")


def test_logit_bias_steers_a_greedy_choice(client: openai.OpenAI) -> None:
    base = _chat(client, max_tokens=1).choices[0].message.content
    target = "Q" if base != "Q" else "Z"
    biased = _chat(client, max_tokens=1, logit_bias={str(ord(target)): 100})
    assert biased.choices[0].message.content == target
    banned = _chat(client, max_tokens=1, logit_bias={str(ord(base or " ")): -100})
    assert banned.choices[0].message.content != base


def test_min_tokens_and_ignored_bookkeeping_fields(client: openai.OpenAI) -> None:
    extra = {"min_tokens": 12, "prompt_cache_retention": "24h"}  # no disk tier: RAM as always
    response = _chat(client, max_tokens=12, extra_body=extra, store=False,
                     metadata={"run": "1"}, user="u", prompt_cache_key="k")  # fmt: skip
    assert response.usage is not None and response.usage.completion_tokens == 12


BAD_TOOL = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"a": {"type": "strin"}}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [BAD_TOOL]}, "tool 'broken' parameters cannot be compiled"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}
                ]
            },
            "must describe an object",
        ),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]},
            "matches no tool call",
        ),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "objectx"}, "strict": True},
                }
            },
            "cannot be compiled",
        ),
        ({"logit_bias": {"99999": 5}}, "outside the vocabulary"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_inputs_are_400s_with_a_message(
    server: LiveServer, client: openai.OpenAI, body: dict[str, Any], message: str
) -> None:
    response = server.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_a_resent_plain_turn_is_cached_whole(client: openai.OpenAI) -> None:
    first = _chat(client, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=24)
    message = first.choices[0].message.model_dump(exclude_none=True)
    follow = [{"role": "user", "content": "tell me a story"}, message,
              {"role": "user", "content": "more"}]  # fmt: skip
    second = _chat(client, messages=follow, max_tokens=4)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    computed = first.usage.prompt_tokens + first.usage.completion_tokens
    # cut by max_tokens, the last token has no KV yet
    assert cached == computed - 1


def test_assistant_messages_as_the_client_returns_them(server: LiveServer) -> None:
    """OpenAI's message objects carry null refusal/audio/function_call and annotations."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    assistant = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None,
                 "audio": None, "function_call": None, "annotations": []}  # fmt: skip
    messages = [*USER, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    response = server.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "tools": [ADD], "max_tokens": 2})  # fmt: skip
    assert response.status_code == 200, response.text
