"""ChatAgents and ChatOutputs: the per-server object that plans a request's grammar and turns
outputs into OpenAI messages, remembering each for the next turn."""

from __future__ import annotations

from typing import Any

import pytest
from agent_helpers import ADD, WEATHER
from tiny_tokenizers import byte_level

from radixlm.agents.chat import ChatAgents, ChatOutputs

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def agents() -> ChatAgents:
    return ChatAgents(byte_level(), 330)


def test_plan_picks_the_grammar(agents: ChatAgents) -> None:
    assert agents.plan(None, None, None, None).constraint is None
    auto = agents.plan([ADD], None, None, None)
    assert auto.choice.mode == "auto" and auto.parse_calls and auto.constraint is None
    assert agents.plan([ADD], "required", None, None).constraint is not None
    assert agents.plan([ADD], "none", None, None).parse_calls is False
    json_mode = agents.plan(None, None, None, {"type": "json_object"})
    assert json_mode.constraint is not None and "json_object" in json_mode.constraint.description
    # a forced tool choice constrains the output, whatever the response format says
    both = agents.plan([WEATHER], "required", False, {"type": "json_object"})
    assert both.constraint is not None and "tools" in both.constraint.description


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([ADD, ADD], None, None, None), "used by two tools"),
        (([ADD], {"type": "function", "function": {"name": "x"}}, None, None), "not in tools"),
        ((None, "auto", None, None), "needs tools"),
        ((None, None, None, {"type": "json_schema", "json_schema": {"name": "n"}}), "schema"),
        ((None, None, None, {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "nope"}}}), "cannot be compiled"),
    ],
)  # fmt: skip
def test_plan_errors_name_the_problem(
    agents: ChatAgents, args: tuple[Any, ...], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        agents.plan(*args)


def test_outputs_streamed_or_whole_agree_and_are_remembered(agents: ChatAgents) -> None:
    tokenizer = byte_level()
    plan = agents.plan([ADD], "required", None, None)
    text = "ok\n" + CALL
    ids = tokenizer.encode(text, add_special_tokens=False) + sorted(tokenizer.eos_token_ids)[-1:]
    reply = ChatOutputs(agents, plan, "ns").message(text, ids)
    content, calls = reply.content, reply.calls
    assert content == "ok" and [c.name for c in calls] == ["add"]
    recalled = agents.memo.recall("ns", "ok", [("add", '{"a": 1, "b": 2}')])
    assert recalled == tuple(ids[:-1])  # the end-of-turn id is the template's to write
    streamed = ChatOutputs(agents, plan, "ns2")
    pieces = [streamed.delta(0, text[i : i + 5], ids[i : i + 5]) for i in range(0, len(text), 5)]
    rest, streamed_reply = streamed.finish(0)
    assert streamed_reply.calls and "".join(p.content for p in [*pieces, rest]) == "ok"
    args = "".join(c.arguments for p in [*pieces, rest] for c in p.calls)
    assert args == calls[0].arguments
    assert agents.memo.recall("ns2", "ok", [("add", '{"a": 1, "b": 2}')]) == tuple(ids[:-1])


def test_text_cut_by_a_stop_string_is_not_remembered(agents: ChatAgents) -> None:
    plan = agents.plan(None, None, None, None)
    ids = byte_level().encode("hello world", add_special_tokens=False)
    ChatOutputs(agents, plan, "stop").message("hello", ids)  # the ids say more than the text
    assert agents.memo.recall("stop", "hello", []) is None
    ChatOutputs(agents, plan, "stop").message("hello world", ids)
    assert agents.memo.recall("stop", "hello world", []) == tuple(ids)
