"""Cache reports from a live server: `return_cache_report` on chat requests, the counters in
/metrics, GET /v1/cache/report, and `radixlm lint` agreeing with the server on the same bodies.

Each crafted sequence starts with its own first word, so what another test left in the tree
never sits where a sequence diverges."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import sse_events
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.commands.lint import lint_bodies

API_KEY = "test-key"
pytestmark = pytest.mark.timeout(120)
SYSTEM = "You are a helpful assistant. Answer briefly and cite your sources."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    with live_server(model, api_key=API_KEY) as live:
        yield live


def chat(*messages: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


def ask(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    """Send `body` asking for a report; the response (its cache_report included)."""
    full = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, **body}
    response = server.post("/v1/chat/completions", json={**full, "return_cache_report": True})
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    server.wait_idle()  # its prompt and output are in the tree before the next request
    return out


def sequence(server: LiveServer) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The crafted requests, each with the server's response (the bodies `lint` replays)."""
    tools = "\n".join(json.dumps({"name": n, "parameters": {}}) for n in ("grep", "ls", "cat"))
    shuffled = "\n".join(json.dumps({"name": n, "parameters": {}}) for n in ("cat", "grep", "ls"))
    bodies = [
        chat(("system", f"Alpha. {SYSTEM}"), ("user", "Explain radix trees.")),
        chat(("system", f"Beta 2026-12-01 15:20:31 {SYSTEM}"), ("user", "Hi")),
        chat(("system", f"Beta 2026-12-01 15:21:07 {SYSTEM}"), ("user", "Hi")),
        chat(("system", f"Gamma tools:\n{tools}"), ("user", "List files")),
        chat(("system", f"Gamma tools:\n{shuffled}"), ("user", "List files")),
        chat(("system", f"Delta. {SYSTEM}"), ("user", "Hi"), cache_salt="tenant-a"),
        chat(("system", f"Delta. {SYSTEM}"), ("user", "Hi"), cache_salt="tenant-b"),
        chat(("system", f"Epsilon. {SYSTEM}"), ("user", "Hi")),
    ]
    out = [(body, ask(server, body)) for body in bodies]
    # The assistant turn sent back with something stripped: a different previous turn.
    said = out[-1][1]["choices"][0]["message"]["content"]
    rerendered = chat(
        ("system", f"Epsilon. {SYSTEM}"), ("user", "Hi"), ("assistant", "Sure. " + said),
        ("user", "And then?"),
    )  # fmt: skip
    out.append((rerendered, ask(server, rerendered)))
    return out


EXPECTED = [
    ("new_content", None),
    ("new_content", "messages[0].content"),
    ("volatile", "messages[0].content"),
    ("new_content", "messages[0].content"),
    ("reordered", "messages[0].content"),
    ("new_content", "messages[0].header"),  # a new salt: even the template is not cached
    ("salt", "messages[0].header"),
    ("new_content", "messages[0].content"),
    ("different_previous_turn", "messages[2].content"),
]


def test_reports_reasons_metrics_and_lint_agree(server: LiveServer, tmp_path: Path) -> None:
    server.post("/v1/cache/flush").raise_for_status()
    done = sequence(server)
    reports = [response["cache_report"] for _, response in done]
    got = [(r["reason"], r["segment"]) for r in reports]
    assert [g[0] for g in got] == [e[0] for e in EXPECTED], got
    for (reason, segment), (_, want) in zip(got, EXPECTED):
        assert want is None or segment == want, (reason, segment, want)
    volatile = reports[2]
    assert volatile["before"].endswith("15:2") and volatile["after"].startswith("1:07")
    assert volatile["tree_after"].startswith("0:31") and volatile["lost_tokens"] > 40
    assert reports[6]["cached_len"] == 0 and reports[6]["lost_tokens"] > 0
    for report, (_, response) in zip(reports, done):  # the report's match is the engine's
        cached = response["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
        assert cached is None or cached == report["cached_len"]

    metrics = server.get("/metrics").text
    assert 'radixlm_cache_reports_total{reason="volatile"} 1.0' in metrics
    assert 'radixlm_cache_lost_tokens_total{reason="reordered"}' in metrics
    summary = server.get("/v1/cache/report").json()
    assert summary["by_reason"]["volatile"]["count"] >= 1
    assert summary["by_reason"]["volatile"]["lost_tokens"] == volatile["lost_tokens"]
    assert summary["by_segment"]["system.content"]["count"] >= 3
    assert summary["recent"][0]["reason"] == "different_previous_turn"

    # `radixlm lint` over the same bodies (answers included) gives the same reasons.
    lines = [{**body, "response": response} for body, response in done]
    offline = lint_bodies(lines, server.engine.tokenizer)
    assert [(r.reason, r.segment, r.cached_len) for r in offline] == [
        (r["reason"], r["segment"], r["cached_len"]) for r in reports
    ]


def test_evicted_prefix_says_when(server: LiveServer) -> None:
    body = chat(("system", f"Zeta. {SYSTEM}"), ("user", "Remember me"))
    ask(server, body)
    server.post("/v1/cache/flush").raise_for_status()  # evicts every unlocked node
    report = ask(server, body)["cache_report"]
    assert report["reason"] == "evicted" and report["evicted_at"] is not None
    assert report["cached_len"] == 0 and report["lost_tokens"] == report["prompt_len"] - 1
    assert "KV slots" in report["fix"]


def test_streamed_report_and_no_report_unless_asked(server: LiveServer) -> None:
    body = chat(("system", f"Eta. {SYSTEM}"), ("user", "Stream it"))
    plain = server.post("/v1/chat/completions", json={**body, "max_tokens": 2}).json()
    assert "cache_report" not in plain
    streamed = server.post(
        "/v1/chat/completions",
        json={**body, "max_tokens": 2, "stream": True, "return_cache_report": True},
    )
    events = sse_events(streamed.text)
    assert events[0]["cache_report"]["reason"] == "hit"
    assert all("cache_report" not in e for e in events[1:])
    server.wait_idle()
