"""The miss explanations: crafted request sequences replayed through a tree (no model), each
asserting the reason, the position and the prompt segment of the miss."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tiny_tokenizers import byte_level

from radixlm.observatory.replay import PromptReplay
from radixlm.tokenizer import Tokenizer

SYSTEM = "You are a helpful assistant. Answer briefly and cite your sources."
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("search", "calculator", "weather")
]


def chat(*messages: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_level()


def test_repeated_prompt_is_a_hit(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer)
    body = chat(("system", SYSTEM), ("user", "What is a radix tree?"))
    assert replay.request(body).reason == "new_content"  # an empty tree: all of it is new
    report = replay.request(body)
    assert report.reason == "hit" and report.cached_len == report.prompt_len - 1


def test_timestamp_on_top_is_volatile(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer)
    replay.request(chat(("system", f"Now: 2026-12-01 15:20:31\n{SYSTEM}"), ("user", "Hi")))
    report = replay.request(chat(("system", f"Now: 2026-12-01 15:21:07\n{SYSTEM}"), ("user", "Hi")))
    assert report.reason == "volatile"
    assert report.segment == "messages[0].content" and report.segment_kind == "system.content"
    assert report.before.endswith("2026-12-01 15:2") and report.after.startswith("1:07")
    assert report.tree_after is not None and report.tree_after.startswith("0:31")
    assert report.lost_tokens > len(SYSTEM) // 4  # the whole system prompt after it
    assert "end of the prompt" in (report.fix or "")


def test_shuffled_tools_field_still_hits(tokenizer: Tokenizer) -> None:
    """Tools in the `tools` field are sorted before rendering: their order cannot miss."""
    replay = PromptReplay(tokenizer)
    replay.request(chat(("system", SYSTEM), ("user", "Hi"), tools=TOOLS))
    report = replay.request(chat(("system", SYSTEM), ("user", "Hi"), tools=TOOLS[::-1]))
    assert report.reason == "hit"


def test_shuffled_tools_in_the_system_prompt_are_reordered(tokenizer: Tokenizer) -> None:
    """A client that writes its tools into the prompt itself, in another order each time."""
    lines = [json.dumps(t["function"]) for t in TOOLS]
    replay = PromptReplay(tokenizer)
    replay.request(chat(("system", "Tools:\n" + "\n".join(lines)), ("user", "Hi")))
    report = replay.request(chat(("system", "Tools:\n" + "\n".join(lines[::-1])), ("user", "Hi")))
    assert report.reason == "reordered" and report.segment == "messages[0].content"
    assert report.before.endswith('{"name": "') and report.after.startswith("weather")
    assert "stable order" in (report.fix or "")


def test_re_rendered_assistant_turn(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer)
    first = chat(("system", SYSTEM), ("user", "Hi"))
    replay.request({**first, "response": "<think>greet back</think>Hello! How can I help?"})
    second = chat(
        ("system", SYSTEM), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
        ("user", "Tell me a joke"),
    )  # fmt: skip
    report = replay.request(second)
    assert report.reason == "different_previous_turn"
    assert report.segment == "messages[2].content"
    assert report.after.startswith("Hello!") and (report.tree_after or "").startswith("<think>")
    # Sent back as received, the same conversation goes on from the cache.
    same = chat(
        ("system", SYSTEM), ("user", "Hi"),
        ("assistant", "<think>greet back</think>Hello! How can I help?"), ("user", "A joke"),
    )  # fmt: skip
    report = replay.request(same)
    assert report.reason == "new_content" and report.segment == "messages[3].header"


def test_evicted_prefix(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer, capacity=200)
    first = chat(("system", SYSTEM), ("user", "First question about caching " * 2))
    replay.request(first)
    replay.request(chat(("system", "Another app entirely. " * 6), ("user", "Unrelated")))
    report = replay.request(first)
    assert report.reason == "evicted" and report.evicted_at is not None
    # The match ends where the two system prompts part, and the rest had been cached
    assert report.segment == "messages[0].content" and report.before.endswith("system\n")
    assert report.lost_tokens == report.prompt_len - 1 - report.cached_len


def test_new_content_and_position(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer)
    replay.request(chat(("system", SYSTEM), ("user", "Explain radix trees.")))
    report = replay.request(chat(("system", SYSTEM), ("user", "Why is the sky blue?")))
    assert report.reason == "new_content" and report.segment == "messages[1].content"
    assert report.segment_kind == "user.content" and report.lost_tokens == 0
    prefix = tokenizer.hf_tokenizer.decode(
        replay.renderer.prompt_ids(chat(("system", SYSTEM), ("user", "W"))["messages"])
    )
    assert isinstance(prefix, str)
    assert report.before == prefix[: prefix.rindex("W")][-40:]


def test_another_salt(tokenizer: Tokenizer) -> None:
    replay = PromptReplay(tokenizer)
    body = chat(("system", SYSTEM), ("user", "Hi"))
    replay.request({**body, "cache_salt": "tenant-a"})
    report = replay.request({**body, "cache_salt": "tenant-b"})
    assert report.reason == "salt" and report.cached_len == 0
    assert report.lost_tokens == report.prompt_len - 1


def test_tool_call_sent_back_re_serialized(tokenizer: Tokenizer) -> None:
    """The model wrote its call's arguments one way; the client sends them back compacted."""
    replay = PromptReplay(tokenizer)
    first = chat(("system", SYSTEM), ("user", "Look up radix trees"), tools=TOOLS)
    said = '<tool_call>\n{"name": "search", "arguments": {"q": "radix trees"}}\n</tool_call>'
    replay.request({**first, "response": said})
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"q":"radix trees"}'}}  # fmt: skip
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "A radix tree is a trie."},
        ],
    }
    report = replay.request(second)
    assert report.reason == "reformatted_turn"  # the same arguments, compacted
    assert (
        report.segment == "messages[2].tool_calls" and report.segment_kind == "assistant.tool_calls"
    )
    assert report.before.endswith('"arguments": {"q":') and report.after.startswith('"radix')
    assert (report.tree_after or "").startswith(' "radix')
