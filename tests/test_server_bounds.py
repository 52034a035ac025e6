"""Bounded work before the engine queues a request: a request costs the server only what its
answer is worth, even when it can never fit.

The rules: a prompt too long to fit is a 400 before it is tokenized in full (nor are a flood of
one-character chat messages rendered); a body over its limit is a 413 before it is read whole; a
client sending a byte every few seconds loses its connection after a bound; a client closing
mid-body leaves no ERROR traceback in the log.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import LiveServer, RecordingHandler, live_server, save_tiny_chat_model

from radixlm.config import CacheConfig, ServerConfig
from radixlm.server.body import BodyLimitMiddleware
from radixlm.server.bounds import json_values_bound

pytestmark = pytest.mark.timeout(180)

CONTEXT = 256
HUGE = "hello " * 2_000_000  # 12 MB: ~3,600 times what can fit a 256-token context


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-bounds"), context_len=CONTEXT)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[LiveServer]:
    config = ServerConfig(
        model_name="tiny", max_body_bytes=16 << 20, body_timeout_s=3.0, body_idle_timeout_s=1.0
    )
    with live_server(model, server=config) as live:
        yield live


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _assert_length_error(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert "cannot fit" in error["message"], error


def test_an_oversized_prompt_is_refused_by_its_length(server: LiveServer) -> None:
    limit = server.cache()["capacity"]  # the pool is larger than the context here
    assert limit > CONTEXT
    chars = server.engine.tokenizer.max_chars_per_token * CONTEXT
    response = server.post("/v1/completions", json={"prompt": "a" * (chars + 1)})
    _assert_length_error(response, "prompt")
    assert f"{chars + 1} characters" in response.json()["error"]["message"]
    assert "context length is 256" in response.json()["error"]["message"]
    batch = server.post("/v1/completions", json={"prompt": ["fine", "b" * (chars + 1)]})
    _assert_length_error(batch, "prompt")
    ids = server.post("/v1/completions", json={"prompt": [65] * 100_000})
    _assert_length_error(ids, "prompt")
    assert server.wait_idle()["idle"]


def test_oversized_chat_content_and_message_counts_are_refused(server: LiveServer) -> None:
    chars = server.engine.tokenizer.max_chars_per_token * CONTEXT
    long = [{"role": "user", "content": "x" * (chars // 2 + 1)}] * 2  # too long only together
    _assert_length_error(server.post("/v1/chat/completions", json={"messages": long}), "messages")
    parts = [{"role": "user", "content": [{"type": "text", "text": "y" * chars}] * 2}]
    _assert_length_error(server.post("/v1/chat/completions", json={"messages": parts}), "messages")
    many = [{"role": "user", "content": "z"}] * 30_000  # the issue sent 300k: 18 s to a 400
    _assert_length_error(server.post("/v1/chat/completions", json={"messages": many}), "messages")
    half = server.post("/v1/chat/completions", json={"messages": long[:1]})
    _assert_length_error(half, "messages")  # one half alone passes as characters, not as tokens
    assert "tokens long" in half.json()["error"]["message"]


def test_bodies_with_more_json_values_than_can_fit_are_refused(server: LiveServer) -> None:
    ids = server.post("/v1/completions", json={"prompt": [[65] * 1000] * 64})
    _assert_length_error(ids, "prompt")
    assert "JSON values" in ids.json()["error"]["message"]
    chat = server.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "z"}] * 5000}
    )
    _assert_length_error(chat, "messages")
    assert server.wait_idle()["idle"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=',[{"\\ab'),
    lambda inner: (
        st.lists(inner, min_size=1) | st.dictionaries(st.text(alphabet=',"\\'), inner, min_size=1)
    ),
    max_leaves=30,
)


def _count_values(value: Any) -> int:
    if isinstance(value, list):
        return 1 + sum(_count_values(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_count_values(v) for v in value.values())
    return 1


@settings(max_examples=100, deadline=None)
@given(json_values, st.booleans())
def test_the_json_value_bound_is_exact_without_empty_containers(value: Any, ascii: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii).encode()
    assert json_values_bound(raw) == _count_values(value)


def test_memory_after_a_burst_of_oversized_requests_returns(server: LiveServer) -> None:
    def oversized() -> httpx.Response:
        return server.post("/v1/completions", json={"prompt": HUGE[: 3 << 20]})

    _assert_length_error(oversized(), "prompt")  # warm up the allocator's arenas
    gc.collect()
    before = _rss_bytes()
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(oversized())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    for response in results:
        _assert_length_error(response, "prompt")
    gc.collect()
    grown = _rss_bytes() - before
    # Tokenizing these used to cost GBs that stayed held; the bodies themselves are 3 MB each.
    assert grown < 200 << 20, f"RSS grew by {grown >> 20} MiB"
    assert server.wait_idle()["idle"]


def test_a_body_over_the_limit_is_a_413_before_it_is_read() -> None:
    pulled: list[int] = []

    async def receive() -> dict[str, Any]:  # a 300 MiB upload, 64 KiB at a time
        pulled.append(1)
        return {"type": "http.request", "body": b"x" * 65_536, "more_body": len(pulled) < 4800}

    sent, called = _run_middleware(receive, max_bytes=1 << 20, headers=[])
    assert sent[0]["status"] == 413 and not called
    assert len(pulled) == 17  # 16 pieces fit in 1 MiB; the 17th passed the limit: stop there
    assert b"larger than 1048576 bytes" in sent[1]["body"]
    declared = [(b"content-length", str(300 << 20).encode())]
    pulled.clear()
    sent, called = _run_middleware(receive, max_bytes=1 << 20, headers=declared)
    assert sent[0]["status"] == 413 and not pulled and not called  # refused on the header alone


def test_a_body_that_trickles_in_is_a_408() -> None:
    async def slow_receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    sent, called = _run_middleware(slow_receive, timeout_s=0.5, idle_timeout_s=10.0)
    assert sent[0]["status"] == 408 and not called
    assert b"whole body" in sent[1]["body"]

    async def stalled() -> dict[str, Any]:
        await asyncio.sleep(30)
        return {"type": "http.request", "body": b"", "more_body": False}

    sent, called = _run_middleware(stalled, timeout_s=30.0, idle_timeout_s=0.2)
    assert sent[0]["status"] == 408 and not called
    assert b"next piece" in sent[1]["body"]


def test_live_body_limits(server: LiveServer) -> None:
    """Over a real socket: a 300 MiB Content-Length, then a client sending a byte at a time."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    with _connect(server) as sock:
        sock.sendall(f"{head}Content-Length: {300 << 20}\r\n\r\n".encode() + b"{" * 65_536)
        assert _response_status(sock) == 413
    with _connect(server) as sock:
        sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode())
        status = None
        for _ in range(200):  # a byte every 50 ms: the 3 s body limit ends it, not the client
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sock.settimeout(0.05)
            try:
                status = _response_status(sock)
                break
            except TimeoutError:
                continue
        sock.settimeout(10)
        status = status or _response_status(sock)
        assert status == 408
    assert server.get("/health").status_code == 200


def test_a_client_closing_mid_body_logs_no_error(server: LiveServer) -> None:
    handler = RecordingHandler()
    records = handler.records
    loggers = [logging.getLogger(name) for name in ("radixlm", "uvicorn.error", "uvicorn")]
    body_log = logging.getLogger("radixlm.server.body")
    level = body_log.level
    for logger in loggers:
        logger.addHandler(handler)
    body_log.setLevel(logging.DEBUG)
    try:
        for _ in range(3):
            with _connect(server) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
                    b'{"prompt": "cut'
                )
        deadline = time.monotonic() + 20
        while sum("mid-body" in r.getMessage() for r in records) < 3:
            assert time.monotonic() < deadline, [r.getMessage() for r in records]
            time.sleep(0.02)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        body_log.setLevel(level)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_a_small_pool_names_the_pool_as_the_limit(model: Path) -> None:
    with live_server(model, cache=CacheConfig(num_slots=64)) as server:
        response = server.post("/v1/completions", json={"prompt": [65] * 100})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "KV pool holds 64 tokens" in message and "context length is 256" in message
        assert "this model serves" not in message
        over = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
        assert "KV pool holds 64 tokens" in over.json()["error"]["message"]


def test_tokenizations_beyond_the_queue_are_a_503(model: Path) -> None:
    config = ServerConfig(max_concurrent_tokenizations=1, max_queued_tokenizations=0)
    with live_server(model, server=config) as server:
        entered, release = threading.Event(), threading.Event()
        tokenizer = server.engine.tokenizer
        encode = tokenizer.encode

        def blocked_encode(text: str, **kwargs: Any) -> list[int]:
            entered.set()
            release.wait(30)
            return encode(text, **kwargs)

        tokenizer.encode = blocked_encode
        try:
            first: list[httpx.Response] = []
            worker = threading.Thread(
                target=lambda: first.append(
                    server.post("/v1/completions", json={"prompt": "one", "max_tokens": 1})
                )
            )
            worker.start()
            assert entered.wait(30)  # the first holds the only tokenizer thread
            busy = server.post("/v1/completions", json={"prompt": "two", "max_tokens": 1})
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "tokenizer_busy"
            assert busy.headers["Retry-After"] == "1"
        finally:
            release.set()
            tokenizer.encode = encode
        worker.join(30)
        assert first[0].status_code == 200
        assert server.wait_idle()["idle"]


# ---- helpers --------------------------------------------------------------------------------
def _run_middleware(
    receive: Any,
    *,
    max_bytes: int = 1 << 20,
    timeout_s: float = 30.0,
    idle_timeout_s: float = 10.0,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    called = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal called
        called = True

    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    middleware = BodyLimitMiddleware(app, max_bytes, timeout_s, idle_timeout_s)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": headers or [],
    }
    asyncio.run(middleware(scope, receive, send))
    return sent, called


def _connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _response_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed without a response: {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])
