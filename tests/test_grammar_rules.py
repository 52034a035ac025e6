"""What a chat grammar accepts: tool arguments closed as OpenAI's strict mode closes them, the
response format as the text branch under auto, allowed_tools narrowing the calls, and schemas
whose references loop refused before they compile."""

from __future__ import annotations

from typing import Any

import pytest
from agent_helpers import ADD, WEATHER
from tiny_tokenizers import byte_level

from radixlm.agents.chat import ChatAgents
from radixlm.agents.grammar import Constraint, GrammarError
from radixlm.agents.schemas import check_ref_loops, closed_schema

LOOSE = {  # what LangChain's bind_tools and raw dict tools send: no additionalProperties
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
            "required": ["a"],
        },
    },
}
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


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _accepts(constraint: Constraint | None, text: str) -> bool:
    assert constraint is not None
    matcher = constraint.new_matcher()
    try:
        for token in byte_level().encode(text, add_special_tokens=False):
            matcher.advance(token)
    except GrammarError:
        return False
    return True


@pytest.fixture(scope="module")
def agents() -> ChatAgents:
    return ChatAgents(byte_level(), 330)


def test_forced_non_strict_arguments_are_closed(agents: ChatAgents) -> None:
    """A missing additionalProperties means false: only declared keys, once each, in order."""
    plan = agents.plan([LOOSE], "required", False, None)
    assert _accepts(plan.constraint, _call("lookup", '{"a": 1, "b": true}'))
    assert _accepts(plan.constraint, _call("lookup", '{"a": 1}'))
    assert not _accepts(plan.constraint, _call("lookup", '{"a": 1, "c": 2}'))  # invented key
    assert not _accepts(plan.constraint, _call("lookup", '{"a": 1, "a": 2}'))  # duplicate
    assert not _accepts(plan.constraint, _call("lookup", '{"b": true, "a": 1}'))  # reordered


def test_a_non_strict_response_format_is_closed_too(agents: ChatAgents) -> None:
    """instructor's JSON_SCHEMA mode sends its schema without additionalProperties."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    plan = agents.plan(None, None, None, fmt)
    assert _accepts(plan.constraint, '{"a": 1}')
    assert not _accepts(plan.constraint, '{"a": 1, "b": 2}')
    assert _accepts(agents.plan(None, None, None, {"type": "json_object"}).constraint, '{"z": 1}')


def test_under_auto_the_text_branch_is_the_response_format(agents: ChatAgents) -> None:
    plan = agents.plan([LOOSE], "auto", None, FORECAST)
    assert plan.parse_calls
    assert _accepts(plan.constraint, '{"rain": true}')
    assert _accepts(plan.constraint, _call("lookup", '{"a": 3}'))
    assert not _accepts(plan.constraint, "It will rain.")  # free text is not the format
    assert not _accepts(plan.constraint, '{"snow": true}')


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_narrow_the_calls_not_the_prompt(agents: ChatAgents, mode: str) -> None:
    choice = {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": "add"}}]}}  # fmt: skip
    plan = agents.plan([WEATHER, ADD], choice, None, None)
    assert [t.name for t in plan.tools] == ["add", "get_weather"]  # both stay in the prompt
    assert _accepts(plan.constraint, _call("add", '{"a": 1, "b": 2}'))
    assert not _accepts(plan.constraint, _call("get_weather", '{"city": "Oslo"}'))
    assert _accepts(plan.constraint, "plain text") == (mode == "auto")


@pytest.mark.parametrize(
    ("choice", "error"),
    [
        ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}}, "mode"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "non-empty"),
        (
            {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "nope"}}],
                },
            },
            "not in tools",
        ),
    ],
)
def test_bad_allowed_tools_name_the_problem(agents: ChatAgents, choice: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        agents.plan([ADD], choice, None, None)


def test_closed_schema_reaches_every_object_and_keeps_what_is_said() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
            "list": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
            "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
            "open": {"type": "object", "additionalProperties": True},
            "pattern": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        },
        "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    }
    closed = closed_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["inner"]["additionalProperties"] is False
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["pattern"]
    assert "additionalProperties" not in props["list"]  # an array
    assert "additionalProperties" not in schema  # the input is left alone
    assert closed_schema({"type": "object"}) == {"type": "object"}  # any object: stays open


@pytest.mark.parametrize(
    ("schema", "loops"),
    [
        ({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}, True),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a", "title": "B"}},
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/a"}},
            },
            True,
        ),
        ({"$ref": "#"}, True),
        (
            {
                "$defs": {
                    "Node": {
                        "type": "object",
                        "properties": {
                            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}
                        },
                    }
                },
                "$ref": "#/$defs/Node",
            },
            False,
        ),
        ({"type": "object", "properties": {"again": {"$ref": "#"}}}, False),
    ],
)
def test_ref_loops_are_found_and_recursion_is_not(schema: dict[str, Any], loops: bool) -> None:
    if loops:
        with pytest.raises(ValueError, match="loops on itself"):
            check_ref_loops(schema, "s")
    else:
        check_ref_loops(schema, "s")
