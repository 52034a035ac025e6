"""A call is a call only once it is closed: streamed calls arrive whole, an output cut by
max_tokens never ends in a call, and a block that is not a call is text exactly as written."""

from __future__ import annotations

import pytest

from radixlm.agents.chat import finish_reason
from radixlm.agents.tool_parser import ToolCallParser, parse_tool_calls

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize(
    "cut_at", [len("<tool_call>\n{"), ADD.index('"b"'), len(ADD) - len("\n</tool_call>")]
)
def test_an_output_cut_inside_a_call_ends_in_text(cut_at: int) -> None:
    text = ADD + "\n" + ADD[:cut_at]
    parsed = parse_tool_calls(text, cut=True)
    assert [c.name for c in parsed.tool_calls] == ["add"]  # the closed one only
    assert parsed.content == ADD[:cut_at]
    parser = ToolCallParser()
    deltas = [parser.feed(ch) for ch in text] + [parser.finish(cut=True)]
    assert [c.name for d in deltas for c in d.calls] == ["add"]
    assert "".join(d.content for d in deltas) == ADD[:cut_at]


def test_a_call_is_streamed_only_once_closed() -> None:
    parser = ToolCallParser()
    assert parser.feed(ADD[:-1]).calls == []  # one character short of its closing tag
    [call] = parser.feed(ADD[-1]).calls
    assert (call.index, call.name, call.arguments) == (0, "add", '{"a": 1, "b": 2}')
    assert call.id.startswith("call_")


def test_a_block_that_is_not_a_call_keeps_its_whitespace() -> None:
    text = 'see  <tool_call> tag\n<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call> x'
    assert parse_tool_calls(text).content == text
    parser = ToolCallParser()
    streamed = "".join(parser.feed(ch).content for ch in text) + parser.finish().content
    assert streamed == text


def test_finish_reason_is_length_whenever_the_output_was_cut() -> None:
    assert finish_reason("stop", made_calls=True) == "tool_calls"
    assert finish_reason("length", made_calls=True) == "length"
    assert finish_reason("stop", made_calls=False) == "stop"
