"""Strict input: every bad request is a 4xx with an OpenAI-style error, and the server stays up.

The corpus covers malformed bodies, unknown and unsupported parameters, wrong types, values out
of range, empty or malformed messages, prompts outside the vocabulary or longer than the context,
an unknown model and unknown routes. After each one, /health answers and the accounting is idle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model

pytestmark = pytest.mark.timeout(120)

CONTEXT = 256
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def _c(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": OK_MESSAGES, "max_tokens": 2, **fields}


# (id, method, path, body: JSON-able object or raw bytes, expected status, param named or None)
CORPUS: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed-json", "POST", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("nan-literal", "POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("empty-body", "POST", "/v1/completions", b"", 400, None),
    ("body-is-array", "POST", "/v1/completions", [1, 2], 400, None),
    ("missing-prompt", "POST", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("unknown-param", "POST", "/v1/completions", _c(foo=1), 400, "foo"),
    ("cache-retention-unknown", "POST", "/v1/chat/completions",
     _chat(prompt_cache_retention="1h"), 400, "prompt_cache_retention"),
    ("temperature-string", "POST", "/v1/completions", _c(temperature="0.5"), 400, "temperature"),
    ("temperature-negative", "POST", "/v1/completions", _c(temperature=-1), 400, "temperature"),
    ("temperature-too-high", "POST", "/v1/completions", _c(temperature=3), 400, "temperature"),
    ("top-p-zero", "POST", "/v1/completions", _c(top_p=0), 400, "top_p"),
    ("top-p-over-one", "POST", "/v1/completions", _c(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", "POST", "/v1/completions", _c(top_k=-2), 400, "top_k"),
    ("min-p-over-one", "POST", "/v1/completions", _c(min_p=2), 400, "min_p"),
    ("repetition-penalty-zero", "POST", "/v1/completions", _c(repetition_penalty=0), 400,
     "repetition_penalty"),
    ("presence-penalty-high", "POST", "/v1/completions", _c(presence_penalty=3), 400,
     "presence_penalty"),
    ("frequency-penalty-low", "POST", "/v1/completions", _c(frequency_penalty=-3), 400,
     "frequency_penalty"),
    ("max-tokens-zero", "POST", "/v1/completions", _c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "POST", "/v1/completions", _c(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", "POST", "/v1/completions", _c(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-over-context", "POST", "/v1/completions", _c(max_tokens=10**6), 400,
     "max_tokens"),
    ("n-zero", "POST", "/v1/completions", _c(n=0), 400, "n"),
    ("n-huge", "POST", "/v1/completions", _c(n=1000), 400, "n"),
    ("n-bool", "POST", "/v1/completions", _c(n=True), 400, "n"),
    ("seed-negative", "POST", "/v1/completions", _c(seed=-1), 400, "seed"),
    ("prompt-empty-string", "POST", "/v1/completions", _c(prompt=""), 400, "prompt"),
    ("prompt-empty-list", "POST", "/v1/completions", _c(prompt=[]), 400, "prompt"),
    ("prompt-id-outside-vocab", "POST", "/v1/completions", _c(prompt=[10**6]), 400, "prompt"),
    ("prompt-id-negative", "POST", "/v1/completions", _c(prompt=[-1]), 400, "prompt"),
    ("prompt-mixed-list", "POST", "/v1/completions", _c(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-number", "POST", "/v1/completions", _c(prompt=5), 400, "prompt"),
    ("prompt-over-context", "POST", "/v1/completions", _c(prompt=[65] * (CONTEXT + 10)), 400,
     "prompt"),
    ("stop-empty", "POST", "/v1/completions", _c(stop=""), 400, "stop"),
    ("stop-too-many", "POST", "/v1/completions", _c(stop=[f"s{i}" for i in range(17)]), 400,
     "stop"),
    ("stop-token-ids-negative", "POST", "/v1/completions", _c(stop_token_ids=[-1]), 400,
     "stop_token_ids"),
    ("logprobs-too-many", "POST", "/v1/completions", _c(logprobs=21), 400, "logprobs"),
    ("echo-unsupported", "POST", "/v1/completions", _c(echo=True), 400, "echo"),
    ("best-of-unsupported", "POST", "/v1/completions", _c(best_of=3), 400, "best_of"),
    ("suffix-unsupported", "POST", "/v1/completions", _c(suffix="x"), 400, "suffix"),
    ("logit-bias-outside-vocab", "POST", "/v1/completions", _c(logit_bias={"99999": 5}), 400,
     "logit_bias"),
    ("stream-options-without-stream", "POST", "/v1/completions",
     _c(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream-options-unknown-key", "POST", "/v1/completions",
     _c(stream=True, stream_options={"foo": True}), 400, "stream_options.foo"),
    ("cache-salt-empty", "POST", "/v1/completions", _c(cache_salt=""), 400, "cache_salt"),
    ("unknown-model", "POST", "/v1/completions", _c(model="gpt-4"), 404, "model"),
    ("chat-messages-empty", "POST", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("chat-messages-missing", "POST", "/v1/chat/completions", {"max_tokens": 2}, 400,
     "messages"),
    ("chat-messages-string", "POST", "/v1/chat/completions", _chat(messages="hi"), 400,
     "messages"),
    ("chat-role-unknown", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("chat-content-missing", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    ("chat-content-number", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    ("chat-image-part", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content"),
    ("chat-top-logprobs-without-logprobs", "POST", "/v1/chat/completions",
     _chat(top_logprobs=3), 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", "POST", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-tool-bad-name", "POST", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, "tools"),
    ("chat-json-schema-missing", "POST", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema"}), 400, "response_format"),
    ("chat-both-token-limits", "POST", "/v1/chat/completions",
     _chat(max_completion_tokens=3), 400, "max_completion_tokens"),
    ("chat-functions-unknown", "POST", "/v1/chat/completions", _chat(functions=[]), 400,
     "functions"),
    ("chat-prompt-over-context", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x" * (CONTEXT + 10)}]), 400, "messages"),
    ("wrong-method", "GET", "/v1/completions", None, 405, None),
    ("unknown-route", "POST", "/v1/nothing", {}, 404, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-validation"), context_len=CONTEXT)
    with live_server(model) as live:
        yield live


def test_the_corpus_is_large() -> None:
    assert len(CORPUS) >= 30
    assert len({case[0] for case in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize(("method", "path", "body", "status", "param"),
                         [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])  # fmt: skip
def test_bad_request_is_a_4xx_with_a_message(
    server: LiveServer, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    response = httpx.request(
        method, server.url + path, content=content,
        headers={"Content-Type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert server.get("/health").status_code == 200
    assert server.wait_idle()["idle"]


def test_still_serving_after_the_corpus(server: LiveServer) -> None:
    response = server.post("/v1/completions", json=_c())
    assert response.status_code == 200, response.text
    cache = server.wait_idle()
    assert cache["idle"] and cache["integrity"] == "ok"
