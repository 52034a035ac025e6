"""The server under stress: clients that hang up, a full waiting queue, a long prefill.

Each scenario ends with the slot accounting at idle: no request left, nothing in flight, and
`free + tree == capacity`, read from /v1/cache.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.config import CacheConfig, SchedulerConfig
from radixlm.model.forward_batch import ForwardBatch

pytestmark = pytest.mark.timeout(180)

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}
# longer than any client here waits (the tiny model decodes 900 tokens in under 0.3 s)
ENDLESS = {**LONG, "max_tokens": 8_000}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-lifecycle"), context_len=8_192)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[LiveServer]:
    with live_server(model) as live:
        yield live


def _assert_idle(server: LiveServer) -> dict[str, Any]:
    cache = server.wait_idle()
    assert cache["num_unfinished"] == 0 and cache["num_in_flight"] == 0, cache
    assert cache["num_free"] + cache["num_tree_tokens"] == cache["capacity"], cache
    assert cache["integrity"] == "ok", cache
    return cache


def test_stream_cut_midway_returns_every_slot(server: LiveServer) -> None:
    aborted = _assert_idle(server)["engine_stats"]["aborted_requests"]
    body = {"prompt": "a stream that will be cut", "stream": True, **LONG}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks == 5:
                break  # leaving the block closes the connection mid-stream
    cache = _assert_idle(server)
    assert cache["engine_stats"]["aborted_requests"] == aborted + 1


def test_a_stream_holding_its_text_is_aborted_when_its_client_hangs_up(
    server: LiveServer, model: Path
) -> None:
    """A stream whose every token may still begin its stop string writes nothing after its
    first chunk; its client hanging up still aborts it (it would otherwise decode its 8,000
    tokens for nobody)."""
    from radixlm.tokenizer import Tokenizer

    (a,) = Tokenizer.from_pretrained(str(model)).encode("a", add_special_tokens=False)
    aborted = _assert_idle(server)["engine_stats"]["aborted_requests"]
    body = {"prompt": "a a a", "stream": True, **ENDLESS, "stop": ["a" * 500 + "b"],
            "logit_bias": {str(a): 100}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk; then the text is held back: leave
    cache = _assert_idle(server)
    assert cache["engine_stats"]["aborted_requests"] == aborted + 1


def test_non_streaming_client_that_gives_up_is_aborted(server: LiveServer) -> None:
    aborted = _assert_idle(server)["engine_stats"]["aborted_requests"]
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json={"prompt": "impatient", **ENDLESS}, timeout=0.3)
    cache = _assert_idle(server)
    assert cache["engine_stats"]["aborted_requests"] == aborted + 1


def test_many_streams_cut_at_random_points(server: LiveServer) -> None:
    """Eight streams (some with n = 2) cut after a different number of events each: every one
    had started streaming, every one is aborted (its samples with it), and the cache is left
    with nothing in flight."""
    aborted = _assert_idle(server)["engine_stats"]["aborted_requests"]
    read: dict[int, int] = {}

    def cut_after(k: int) -> None:
        body = {"prompt": f"stream {k}", "stream": True, "n": 1 + k % 2, **ENDLESS}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for i, _ in enumerate(events):
                read[k] = i + 1
                if i + 1 >= 2 * k:
                    break

    threads = [threading.Thread(target=cut_after, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read == {k: 2 * k for k in range(1, 9)}
    cache = _assert_idle(server)
    assert cache["engine_stats"]["aborted_requests"] == aborted + 8  # each cut request


def test_full_waiting_queue_is_a_503_with_retry_after(model: Path) -> None:
    scheduler = SchedulerConfig(max_running_requests=1, max_waiting_requests=1)
    with live_server(model, cache=CacheConfig(num_slots=4096), scheduler=scheduler) as server:
        body = {"prompt": "first", "stream": True, **LONG}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as first:
            assert first.status_code == 200  # headers come with the first token: it runs
            waiting = threading.Thread(
                target=lambda: server.post(
                    "/v1/completions", json={"prompt": "second", "max_tokens": 20}
                ),
                daemon=True,
            )
            waiting.start()
            deadline = time.monotonic() + 20
            while server.cache()["num_waiting"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            third = server.post("/v1/completions", json={"prompt": "third", "max_tokens": 2})
            assert third.status_code == 503, third.text
            assert third.headers["Retry-After"] == "1"
            assert third.json()["error"]["code"] == "queue_full"
        waiting.join(timeout=60)  # the first was cut: the second runs now
        _assert_idle(server)


def test_health_answers_fast_during_a_long_prefill(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = save_tiny_chat_model(
        tmp_path_factory.mktemp("wider"), context_len=4096, hidden=256, num_layers=8
    )
    scheduler = SchedulerConfig(chunk_size=4096, max_batch_tokens=4096)
    with live_server(path, cache=CacheConfig(num_slots=8192), scheduler=scheduler) as server:
        prompt = list(range(3, 259)) * 15  # 3840 tokens in one prefill step
        result: dict[str, float] = {}

        def long_request() -> None:
            start = time.perf_counter()
            server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            result["seconds"] = time.perf_counter() - start

        worker = threading.Thread(target=long_request)
        worker.start()
        latencies = []
        with httpx.Client(base_url=server.url, timeout=10) as probe:
            while worker.is_alive():
                start = time.perf_counter()
                assert probe.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)
        worker.join()
        assert result["seconds"] > 0.3, "the prefill was too quick to test anything"
        assert len(latencies) >= 5
        # A /health that waited for the engine would wait out the rest of the one prefill step,
        # most of its time for some probe; one that never waits answers in a small share of it
        # however busy the host is (an absolute bound is a bet on the host's load).
        assert max(latencies) < 0.25 * result["seconds"], (max(latencies), result)
        _assert_idle(server)


def test_sse_format(server: LiveServer) -> None:
    body = {"prompt": "format", "stream": True, "max_tokens": 3, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_engine_failure_fails_its_requests_and_the_server_keeps_serving(
    server: LiveServer,
) -> None:
    runner = server.engine.engine.runner
    forward = runner.forward

    def failing(batch: ForwardBatch) -> torch.Tensor:
        runner.forward = forward  # type: ignore[method-assign]  # fail once, then work again
        raise RuntimeError("injected failure")

    runner.forward = failing  # type: ignore[method-assign]  # a fault injected into the engine
    try:
        body = {"prompt": "this request meets a broken step", "max_tokens": 5}
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code >= 500
        assert failed.json()["error"]["message"]
    finally:
        runner.forward = forward  # type: ignore[method-assign]  # the engine's own again
    _assert_idle(server)
    # ignore_eos: a sampled end-of-sequence would end it early (the tiny model is random)
    body = {"prompt": "and this one", "max_tokens": 3, "ignore_eos": True}
    ok = httpx.post(server.url + "/v1/completions", json=body)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 3
    _assert_idle(server)
