"""Hardening rules: unexpected 500s are counted and in the OpenAI shape, bad query
parameters are 400s (not FastAPI's 422), and floods of /health and /metrics cost the engine
thread (which the streams wait on) nothing per request."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer, RecordingHandler, live_server, save_tiny_chat_model

from radixlm.config import ServerConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-hardening"), context_len=512)
    config = ServerConfig(model_name="tiny", metrics_snapshot_ttl_s=3600)  # one snapshot
    with live_server(model, server=config) as live:
        yield live


def _count(metrics: str, route: str, status: int) -> float:
    prefix = f'radixlm_requests_total{{route="{route}",status="{status}"}} '
    values = [float(ln[len(prefix) :]) for ln in metrics.splitlines() if ln.startswith(prefix)]
    return values[0] if values else 0.0


def test_an_unexpected_error_is_a_counted_500_logged_once(server: LiveServer) -> None:
    before = _count(server.get("/metrics").text, "/v1/completions", 500)
    tokenizer = server.engine.tokenizer
    handler = RecordingHandler(logging.ERROR)
    records = handler.records
    loggers = [logging.getLogger(name) for name in ("radixlm", "uvicorn.error", "uvicorn")]

    def broken(text: str, **kwargs: Any) -> list[int]:
        raise RuntimeError("injected")

    tokenizer.encode = broken
    for logger in loggers:
        logger.addHandler(handler)
    try:
        response = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    finally:
        del tokenizer.encode  # back to the class's method
        for logger in loggers:
            logger.removeHandler(handler)
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "Internal server error: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert _count(server.get("/metrics").text, "/v1/completions", 500) == before + 1
    assert len([r for r in records if r.levelno >= logging.ERROR]) == 1
    ok = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200
    assert server.wait_idle()["idle"]


def test_bad_query_parameters_are_400s_in_the_openai_shape(server: LiveServer) -> None:
    response = server.get("/v1/cache", params={"check_integrity": "maybe"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "check_integrity" and error["type"] == "invalid_request_error"
    assert "check_integrity" in error["message"]


def test_floods_of_health_and_metrics_do_not_reach_the_engine_thread(server: LiveServer) -> None:
    assert "radixlm_kv_slots" in server.get("/metrics").text  # the snapshot is taken once
    engine = server.engine
    calls: list[Any] = []
    call = engine.call

    async def counting_call(fn: Any) -> Any:
        calls.append(fn)
        return await call(fn)

    engine.call = counting_call  # type: ignore[method-assign]  # counts the engine round trips
    stream_text: list[str] = []
    body = {"prompt": "a stream", "max_tokens": 64, "ignore_eos": True, "stream": True}

    def stream() -> None:
        stream_text.append(server.post("/v1/completions", json=body).text)

    def flood(path: str) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for _ in range(25):
                assert client.get(path).status_code == 200

    threads = [threading.Thread(target=stream)]
    threads += [threading.Thread(target=flood, args=(p,)) for p in ("/health", "/metrics") * 4]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del engine.call
    assert stream_text and stream_text[0].endswith("data: [DONE]\n\n")
    # 200 scrapes and probes; the stream's own enqueue is its only engine round trip
    assert len(calls) <= 1, calls
    assert server.wait_idle()["idle"]
