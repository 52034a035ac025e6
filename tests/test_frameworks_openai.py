"""The official openai SDK, as agent code uses it against radixlm: a tool loop with raw dict tools
(non-strict, no additionalProperties) whose first call is forced, created and streamed; `parse()`
with nested models; the streaming helper with a `pydantic_function_tool`; and a Responses API
loop continued by `previous_response_id`. From step 2 the cached prefix is everything the
previous step computed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from framework_helpers import StepRecorder, check_cached_steps, check_idle, framework_server
from live_server import LiveServer
from openai.types.responses import ResponseInputParam
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(180)

WEATHER: dict[str, Any] = {  # as a hand-written agent sends it: no strict, no extra keywords
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}


class Place(BaseModel):
    city: Literal["Paris", "Oslo"]


class Report(BaseModel):
    place: Place
    celsius: int = Field(ge=-9, le=9)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, StepRecorder]]:
    with framework_server(tmp_path_factory.mktemp("tiny-openai")) as served:
        yield served


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    """One step, streamed or not, as the message and the finish reason."""
    kwargs = {"model": "tiny", "temperature": 0, "max_tokens": 120, "tools": [WEATHER], **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    finish = None
    for chunk in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kwargs):  # fmt: skip
        for choice in chunk.choices:
            message["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                message.setdefault("tool_calls", []).append(call.model_dump(exclude_none=True))
            finish = choice.finish_reason or finish
    for call in message.get("tool_calls", ()):
        call.pop("index")
    return message, finish


@pytest.mark.parametrize("stream", [False, True], ids=["created", "streamed"])
def test_a_tool_loop_with_non_strict_tools(
    served: tuple[LiveServer, StepRecorder], stream: bool
) -> None:
    server, steps = served
    client = _client(server)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Weather in Oslo? ({stream})"}]
    for step in range(4):
        message, finish = _ask(client, stream, messages=messages,
                               tool_choice="required" if step == 0 else "auto")  # fmt: skip
        messages.append(message)
        if finish != "tool_calls":
            break
        for call in message["tool_calls"]:
            city = json.loads(call["function"]["arguments"])["city"]
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {city}"}
            )
    assert messages[1]["tool_calls"] and messages[-1]["role"] == "assistant"
    check_cached_steps(steps.taken())
    check_idle(server)


def test_parse_with_nested_models(served: tuple[LiveServer, StepRecorder]) -> None:
    server, steps = served
    completion = _client(server).chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Report the weather."}],
        response_format=Report, temperature=0, max_tokens=80,
    )  # fmt: skip
    assert isinstance(completion.choices[0].message.parsed, Report)
    assert [s.status for s in steps.taken()] == [200]
    check_idle(server)


def test_the_streaming_helper_with_a_pydantic_tool(served: tuple[LiveServer, StepRecorder]) -> None:
    server, steps = served
    tool = openai.pydantic_function_tool(Report)
    with _client(server).chat.completions.stream(
        model="tiny", messages=[{"role": "user", "content": "Report, streamed."}],
        tools=[tool], tool_choice="required", temperature=0, max_tokens=120,
    ) as stream:  # fmt: skip
        for _ in stream:
            pass
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Report)
    assert [s.status for s in steps.taken()] == [200]
    check_idle(server)


def test_a_responses_loop_by_previous_response_id(served: tuple[LiveServer, StepRecorder]) -> None:
    server, steps = served
    client = _client(server)
    tool = {"type": "function", **WEATHER["function"], "strict": False}
    kwargs: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 120,
                              "tools": [tool], "instructions": "Use the tool."}  # fmt: skip
    response = client.responses.create(input="Weather in Paris?", tool_choice="required", **kwargs)
    for _ in range(3):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        results: ResponseInputParam = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls
        ]
        response = client.responses.create(previous_response_id=response.id, input=results,
                                            **kwargs)  # fmt: skip
    check_cached_steps(steps.taken())
    check_idle(server)
