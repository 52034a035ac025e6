"""`radixlm bench serve --prompt-format text|chat`: what goes through a gateway (smg routes on
text, not token ids), with the replica that served each request and each group's affinity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
from live_server import live_server, save_tiny_chat_model

from radixlm.bench.online_prompts import PromptBook, render_words
from radixlm.bench.workloads import gsp, multiturn
from radixlm.cli import main

pytestmark = pytest.mark.timeout(180)


def test_chat_roots_put_the_shared_prefix_in_the_system_message() -> None:
    workload = gsp(
        token_range=range(3, 256), num_groups=3, prompts_per_group=4, system_prompt_len=20,
        question_len=5, output_len=2,
    )  # fmt: skip
    book = PromptBook(workload, "chat")
    systems: dict[int, set[str]] = {}
    for i in range(len(workload.requests)):
        prompt = book.prompt(i)
        assert isinstance(prompt, list)
        messages = cast(list[dict[str, str]], prompt)  # the "chat" format's
        assert [m["role"] for m in messages] == ["system", "user"]
        assert messages[0]["content"] == render_words(workload.requests[i].new_tokens[:20]).strip()
        systems.setdefault(book.group[i], set()).add(messages[0]["content"])
    assert len(systems) == 3 and all(len(s) == 1 for s in systems.values())
    assert sorted(book.group.count(g) for g in set(book.group)) == [4, 4, 4]


def test_followups_extend_the_parent_by_its_returned_text() -> None:
    workload = multiturn(
        token_range=range(3, 256), num_conversations=2, num_turns=2, turn_len=4, output_len=2
    )
    text, chat = PromptBook(workload, "text"), PromptBook(workload, "chat")
    child = next(i for i, r in enumerate(workload.requests) if r.parent is not None)
    parent = workload.requests[child].parent
    assert parent is not None
    with pytest.raises(ValueError, match="waits for"):
        text.prompt(child)
    first_text, first_chat = text.prompt(parent), chat.prompt(parent)
    text.finish(parent, " said so", [])
    chat.finish(parent, "said so", [])
    followup = render_words(workload.requests[child].new_tokens)
    assert text.prompt(child) == f"{first_text} said so{followup}"
    assert chat.prompt(child) == [
        *first_chat,
        {"role": "assistant", "content": "said so"},
        {"role": "user", "content": followup.strip()},
    ]
    assert text.group[child] == text.group[parent]


@pytest.mark.parametrize("prompt_format", ["text", "chat"])
def test_bench_serve_text_and_chat(tmp_path: Path, prompt_format: str) -> None:
    model = save_tiny_chat_model(tmp_path / "model", context_len=1024)
    out = tmp_path / "bench.json"
    workload = (
        ["--workload", "gsp", "--param", "num_groups=3", "--param", "prompts_per_group=3",
         "--param", "system_prompt_len=24", "--param", "question_len=4"]
        if prompt_format == "chat"
        else ["--workload", "multiturn", "--param", "num_conversations=3",
              "--param", "num_turns=3", "--param", "turn_len=6"]
    )  # fmt: skip
    with live_server(model) as server:
        argv = [
            "bench", "serve", "--base-url", server.url, *workload, "--param", "output_len=4",
            "--token-range", "3:256", "--concurrency", "3", "--prompt-format", prompt_format,
            "--stream", "one-per-group", "--json", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
    result = json.loads(out.read_text())
    summary, rows = result["summary"], result["requests"]
    assert summary["num_errors"] == 0 and summary["num_ok"] == 9
    assert summary["cached_tokens"] > 0 and summary["hit_rate"] > 0.2
    # the prompt ids the server returned give the ideal prefill in its own tokens
    assert summary["ideal_prefill_tokens"] > 0
    assert summary["server_prefill_tokens"] >= summary["ideal_prefill_tokens"]
    assert summary["leaked_slots"] == 0 and summary["accounting_ok"]
    # one replica: every request names it, every group sits on it
    assert summary["requests_by_worker"] == {"127.0.0.1:8000": 9}
    assert summary["min_group_affinity"] == 1.0
    assert summary["num_streams"] == 3 == summary["num_streams_usage_then_done"]
    assert sum(r["streamed"] for r in rows) == 3
    assert all(r["prompt_tokens"] > 0 and r["cached_tokens"] is not None for r in rows)
