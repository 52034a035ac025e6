"""Cache reports on /v1/completions: token-id and text prompts, a batch (one report per prompt),
a stream (the report in the first chunk), another salt; and no report unless asked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers import sse_events
from live_server import LiveServer, live_server, save_tiny_chat_model

API_KEY = "test-key"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    with live_server(model, api_key=API_KEY) as live:
        yield live


def complete(server: LiveServer, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra}
    response = server.post("/v1/completions", json={"return_cache_report": True, **body})
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    server.wait_idle()  # its prompt and output are in the tree before the next request
    return out


def byte_ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer: byte b is token b


def test_token_prompts(server: LiveServer) -> None:
    first = byte_ids("Token prompt one: the quick brown fox jumps over the lazy dog.")
    report = complete(server, first)["cache_report"]
    assert report["reason"] == "new_content" and report["cached_len"] == 0
    assert report["segment"] is None and report["prompt_len"] == len(first)
    again = complete(server, first)
    assert again["cache_report"]["reason"] == "hit"
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again["cache_report"]["cached_len"] == cached == len(first) - 1
    other = first[:20] + byte_ids(" a different ending here, long enough.")
    report = complete(server, other)["cache_report"]
    assert report["reason"] == "new_content" and report["cached_len"] == 20
    assert report["before"].endswith("Token prompt one: th")
    assert report["after"].startswith(" a different") and report["tree_after"].startswith("e quick")


def test_text_prompt_with_a_volatile_value(server: LiveServer) -> None:
    rest = " and then the same long instructions follow for every request."
    complete(server, "Text prompt at 2026-12-01 15:20:31" + rest)
    report = complete(server, "Text prompt at 2026-12-01 15:21:07" + rest)["cache_report"]
    assert report["reason"] == "volatile" and report["before"].endswith("15:2")
    assert report["after"].startswith("1:07") and report["tree_after"].startswith("0:31")
    assert report["lost_tokens"] > 40 and "end of the prompt" in report["fix"]


def test_batch_gets_one_report_per_prompt(server: LiveServer) -> None:
    seen = byte_ids("Batch prompt seen before, with enough tokens to matter.")
    complete(server, seen)
    out = complete(server, [seen, byte_ids("Batch prompt never seen.")])
    reports = out["cache_report"]
    assert isinstance(reports, list) and [r["reason"] for r in reports] == ["hit", "new_content"]
    one = complete(server, [byte_ids("Batch of one.")])["cache_report"]
    assert isinstance(one, list) and len(one) == 1  # a list prompt is a batch, even of one


def test_stream_carries_the_report_first(server: LiveServer) -> None:
    prompt = "Streamed completion prompt."
    complete(server, prompt)
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "return_cache_report": True}
    streamed = server.post("/v1/completions", json=body)
    events = sse_events(streamed.text)
    assert events[0]["cache_report"]["reason"] == "hit"
    assert all("cache_report" not in e for e in events[1:])
    server.wait_idle()


def test_another_salt_and_no_report_unless_asked(server: LiveServer) -> None:
    prompt = byte_ids("Salted completion prompt, shared by two tenants word for word.")
    complete(server, prompt, cache_salt="tenant-a")
    report = complete(server, prompt, cache_salt="tenant-b")["cache_report"]
    assert report["reason"] == "salt" and report["cached_len"] == 0
    assert report["lost_tokens"] == len(prompt) - 1
    plain = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert "cache_report" not in plain
    server.wait_idle()


def test_refused_request_gets_an_error_not_a_report(server: LiveServer) -> None:
    response = server.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 10**6, "return_cache_report": True},
    )
    assert response.status_code == 400 and "cache_report" not in response.text
