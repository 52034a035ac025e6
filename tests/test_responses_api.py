"""POST /v1/responses through the official client: text and function-call items, streamed
events, structured output, stored responses continued with nothing recomputed, and every
unsupported field a 400 naming it. The `client` fixture checks the slot accounting after each
test; calls are forced (the tiny random model cannot decide to call a tool)."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from live_server import LiveServer
from pydantic import BaseModel

pytestmark = pytest.mark.timeout(180)

ADD: dict[str, Any] = {
    "type": "function",
    "name": "add",
    "description": "Add two digits",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                       "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}  # fmt: skip
INSTRUCTIONS = "You add numbers with the add tool."


class Verdict(BaseModel):
    sunny: bool
    mood: Literal["calm", "busy"]


@pytest.fixture(scope="module")
def server_context_len() -> int:
    return 4096


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "temperature": 0, "max_output_tokens": 120, **kwargs}
    return client.responses.create(**kwargs)


def _computed(usage: Any) -> int:
    """What a response left computed in the tree: its input and every output token but the
    last, whose KV no forward pass has made yet."""
    return int(usage.input_tokens + usage.output_tokens - 1)


def _forced_call(client: openai.OpenAI, user: str, **kwargs: Any) -> Any:
    response = _create(client, input=user, instructions=INSTRUCTIONS, tools=[ADD],
                       tool_choice="required", parallel_tool_calls=False, **kwargs)  # fmt: skip
    assert response.status == "completed"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}
    return response, call


def test_text_in_text_out_with_usage(client: openai.OpenAI) -> None:
    response = _create(client, input="hello", max_output_tokens=6)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # cut by max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and response.output_text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    again = _create(client, input="hello", max_output_tokens=6)
    assert again.output_text == response.output_text  # greedy: the same, from the cache
    assert again.usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


def test_a_stored_response_continues_with_nothing_recomputed(client: openai.OpenAI) -> None:
    first, call = _forced_call(client, "What is 2 + 3?")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    second = _create(client, previous_response_id=first.id, input=[result],
                     instructions=INSTRUCTIONS, tools=[ADD], max_output_tokens=4)  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens == _computed(first.usage)
    # a third step goes on from the second, through the chain of stored turns
    third = _create(client, previous_response_id=second.id, input="and 4 + 4?",
                    instructions=INSTRUCTIONS, tools=[ADD], tool_choice="required")  # fmt: skip
    assert third.usage.input_tokens_details.cached_tokens == _computed(second.usage)


def test_resent_output_items_hit_the_cache_as_previous_response_id_does(
    client: openai.OpenAI,
) -> None:
    """What openai-agents sends by default: the whole input again, the output items included."""
    first, call = _forced_call(client, "What is 1 + 6?", store=False)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "7"}
    items = [{"role": "user", "content": "What is 1 + 6?"},
             *[item.model_dump(exclude_none=True) for item in first.output], result]  # fmt: skip
    second = _create(client, input=items, instructions=INSTRUCTIONS, tools=[ADD],
                     max_output_tokens=4)  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens == _computed(first.usage)
    gone = client.with_options(max_retries=0).responses.create
    with pytest.raises(openai.NotFoundError):  # store: false kept nothing
        gone(model="tiny", previous_response_id=first.id, input="x")


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"input": "Add 3 and 4", "instructions": INSTRUCTIONS, "tools": [ADD],
              "tool_choice": "required", "parallel_tool_calls": False}  # fmt: skip
    whole = _create(client, **kwargs)
    with client.responses.stream(model="tiny", temperature=0, max_output_tokens=120,
                                 **kwargs) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.done" in kinds
    call = next(item for item in final.output if item.type == "function_call")
    expected = next(item for item in whole.output if item.type == "function_call")
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_streamed_text_arrives_in_deltas(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="tell me", max_output_tokens=8,
                                 temperature=0) as stream:  # fmt: skip
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut: no response.completed
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert final.status == "incomplete"
    assert getattr(final.output[0], "status", None) == "incomplete"  # an item type with a status


def test_structured_output_with_parse(client: openai.OpenAI) -> None:
    response = client.responses.parse(model="tiny", input="How is the weather?",
                                      text_format=Verdict, temperature=0,
                                      max_output_tokens=60)  # fmt: skip
    assert isinstance(response.output_parsed, Verdict)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_allowed_tools_in_the_responses_shape(client: openai.OpenAI) -> None:
    other = {**ADD, "name": "subtract"}
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "subtract"}]}  # fmt: skip
    response = _create(client, input="5 - 2?", tools=[ADD, other], tool_choice=choice)
    assert {item.name for item in response.output if item.type == "function_call"} == {"subtract"}


def test_retrieve_and_delete_a_stored_response(server: LiveServer, client: openai.OpenAI) -> None:
    response = _create(client, input="keep this", max_output_tokens=3)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    for attempt in (lambda: client.responses.retrieve(response.id),
                    lambda: client.responses.delete(response.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            attempt()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**ADD, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [ADD]}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_a_400_naming_the_field(
    server: LiveServer, client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    response = server.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert _create(client, input="still here", max_output_tokens=2).status == "incomplete"


def test_no_op_fields_are_accepted(client: openai.OpenAI) -> None:
    response = _create(client, input="hi", max_output_tokens=2, metadata={"k": "v"}, user="u",
                       include=["reasoning.encrypted_content"], truncation="disabled",
                       reasoning={"effort": None}, prompt_cache_key="p", safety_identifier="s",
                       text={"format": {"type": "text"}, "verbosity": "medium"})  # fmt: skip
    assert response.metadata == {"k": "v"} and response.status == "incomplete"
