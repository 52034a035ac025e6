"""A returned assistant turn is found again by what it says: its content as text, each call's
arguments as parsed JSON; only ids the client saw are remembered; and when a reformatted turn
misses anyway, the cache report names it, not another salt."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_tokenizers import byte_level, token_id

from radixlm.agents.turns import TurnMemo, turn_ids, turn_key
from radixlm.observatory.replay import PromptReplay


@pytest.mark.parametrize(
    ("generated", "resent", "same"),
    [
        ('{"city": "Oslo", "days": 2}', '{"city":"Oslo","days":2}', True),  # compacted
        ('{"city": "Oslo", "days": 2}', '{"days": 2, "city": "Oslo"}', True),  # reordered
        ('{"city": "Oslo"}', ' {\n  "city": "Oslo"\n}\n', True),  # pretty-printed
        ('{"city": "Oslo"}', '{"city": "Lima"}', False),
        ('{"a": 1}', '{"a": 1.0}', False),  # another JSON value
        ('{"a": 1, "a": 2}', '{"a": 2}', False),  # a repeated key has no one meaning
        ("not json {", "not json {", True),
        ("not json {", "not json  {", False),
    ],
)
def test_calls_compare_as_json(generated: str, resent: str, same: bool) -> None:
    assert (turn_key(None, [("f", generated)]) == turn_key(None, [("f", resent)])) is same


def test_content_compares_as_text_and_names_and_order_count() -> None:
    assert turn_key("hi", []) != turn_key("hi ", [])
    assert turn_key(None, []) == turn_key("", [])  # calls only: no content either way
    calls = [("a", "{}"), ("b", "{}")]
    assert turn_key(None, calls) != turn_key(None, calls[::-1])
    assert turn_key(None, [("a", "{}")]) != turn_key(None, [("b", "{}")])


def test_the_memo_recalls_by_meaning_within_its_namespace() -> None:
    memo = TurnMemo(capacity=2)
    memo.remember("ns", None, [("f", '{"x": 1}')], [5, 6, 7])
    assert memo.recall("ns", None, [("f", '{"x":1}')]) == (5, 6, 7)
    assert memo.recall("other", None, [("f", '{"x": 1}')]) is None
    memo.remember("ns", "a", [], [1])
    memo.remember("ns", "b", [], [2])
    assert memo.recall("ns", None, [("f", '{"x": 1}')]) is None  # least recently used, dropped


def test_only_ids_the_client_saw_are_remembered() -> None:
    tokenizer = byte_level()
    text = "hi there"
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_start, end = token_id(tokenizer, "<|im_start|>"), token_id(tokenizer, "<|im_end|>")
    assert turn_ids(tokenizer, text, [*ids, end]) == tuple(ids)  # the end of turn is dropped
    assert turn_ids(tokenizer, text, [*ids[:2], im_start, *ids[2:]]) is None  # unseen control
    assert turn_ids(tokenizer, "hi", ids) is None  # a stop string cut the text, not the ids


def test_a_reformatted_turn_is_named_even_when_another_salt_holds_more() -> None:
    replay = PromptReplay(byte_level())
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    first: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Look up radix trees"}],
        "tools": tools,
    }
    said = '<tool_call>\n{"name": "search", "arguments": {"q": "radix trees"}}\n</tool_call>'
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"q":"radix trees"}'}}  # fmt: skip
    second = {**first, "messages": [
        *first["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "A trie."}]}  # fmt: skip
    replay.request({**first, "cache_salt": "a", "response": said})
    replay.request({**second, "cache_salt": "b"})  # another salt holds the whole second prompt
    report = replay.request({**second, "cache_salt": "a"})
    assert report.reason == "reformatted_turn" and report.segment == "messages[1].tool_calls"
