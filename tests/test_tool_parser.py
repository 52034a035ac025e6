"""Tool calls out of generated text: the whole-text parser and streamed deltas, which must
reassemble into the same calls wherever the text is cut."""

from __future__ import annotations

import json

import pytest

from radixlm.agents.tool_parser import ToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}{", "n": [1, {}]}}\n</tool_call>'  # noqa: E501
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _calls(text: str) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parse_tool_calls(text).tool_calls]


def test_plain_text_is_content() -> None:
    parsed = parse_tool_calls("Hello <b>there</b>\n")
    assert parsed.content == "Hello <b>there</b>\n" and parsed.tool_calls == []


def test_a_call_with_text_before_it() -> None:
    parsed = parse_tool_calls("Let me check.\n" + CALL)
    assert parsed.content == "Let me check."
    [call] = parsed.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": 'Paris "}{', "n": [1, {}]}
    assert call.id.startswith("call_") and call.to_openai()["type"] == "function"


def test_parallel_calls_and_text_after_them() -> None:
    parsed = parse_tool_calls(CALL + "\n" + ADD + "\nDone.")
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "add"]
    assert parsed.content == "Done."
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parse_tool_calls(CALL + "\n").content is None  # calls only


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f"',  # cut off in the header
        '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',  # cut off in the arguments
        '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',  # not our header
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # not an object
        "a <tool_ b",
    ],
)
def test_what_does_not_parse_stays_text(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_a_call_without_its_closing_tag_is_kept() -> None:
    assert _calls(ADD[: -len("\n</tool_call>")]) == [("add", '{"a": 1, "b": 2}')]
    assert _calls(ADD[: -len("}\n</tool_call>")]) == [("add", '{"a": 1, "b": 2}')]


def test_a_bad_call_between_good_ones_stays_text_in_place() -> None:
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'
    parsed = parse_tool_calls(ADD + "\n" + bad + "\n" + ADD)
    assert [c.name for c in parsed.tool_calls] == ["add", "add"]
    assert parsed.content == bad


def _stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """Content, calls and the number of argument fragments, reassembled from deltas."""
    parser = ToolCallParser()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    fragments = 0
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index not in calls and c.id is not None  # the name comes once
                calls[c.index] = [c.name, ""]
            else:
                fragments += 1
            calls[c.index][1] += c.arguments
    assert sorted(calls) == list(range(len(calls)))  # integer indices from 0
    return content, [(n, a) for n, a in calls.values()], fragments


@pytest.mark.parametrize(
    "text", ["Sure.\n" + CALL, CALL + "\n" + ADD + "\nDone.", "no calls at all \n", ADD]
)
def test_streamed_deltas_reassemble_into_the_same_calls_wherever_cut(text: str) -> None:
    whole = parse_tool_calls(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    for cut in range(1, len(text)):
        content, calls, _ = _stream([text[:cut], text[cut:]])
        assert calls == expected, cut
        assert content == (whole.content or ""), cut
    content, calls, fragments = _stream(list(text))  # one character per delta
    assert calls == expected and content == (whole.content or "")
    assert fragments == 0  # a call is sent whole, once it is closed: never half a call
