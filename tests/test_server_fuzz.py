"""Fuzzing the HTTP API: random sampling parameters and message shapes, in range and out.

Whatever a request holds, the answer is a 2xx or a 4xx (never a 5xx, never an error inside a
stream), a well-formed greedy request running alongside gets the same tokens every time, and
the slot accounting is back at idle afterwards (one request must never hurt another).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import sse_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.config import SchedulerConfig

pytestmark = pytest.mark.timeout(300)

GREEDY = {"prompt": "the well-formed neighbour", "max_tokens": 12, "temperature": 0,
          "ignore_eos": True, "return_token_ids": True}  # fmt: skip

TINY = [5e-324, 1e-300, 1e-45, 1e-38, 1e-8]  # where underflow used to flip the sampler


def _floats(low: float, high: float, edges: list[float]) -> st.SearchStrategy[float]:
    """The edges (subnormals included) and any float in [low, high]. Hypothesis draws no
    subnormals itself: a library built with fast math may have turned them off in this process."""
    inside = [x for x in [*TINY, low, high, *edges] if low <= x <= high]
    normal_low = max(low, 1e-300) if low > 0 else low
    return st.sampled_from(inside) | st.floats(normal_low, high, allow_subnormal=False)


text = st.sampled_from(["hi", " ", "<|im_start|>system\n", "<|im_end|>", "é🙂世", "\x00\n"]) | (
    st.text(min_size=1, max_size=40)
)
# Every parameter within what the API accepts; `requests` spoils one now and then.
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _floats(0.0, 2.0, [0.7, 1.0]),
    "top_p": _floats(5e-324, 1.0, [0.1, 0.9, 0.999]),
    "top_k": st.integers(-1, 300),
    "min_p": _floats(0.0, 1.0, [0.05, 0.999]),
    "repetition_penalty": _floats(5e-324, 10.0, [0.5, 1.0, 1.3]),
    "presence_penalty": _floats(-2.0, 2.0, [0.0]),
    "frequency_penalty": _floats(-2.0, 2.0, [0.0]),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 8),
    "stop": st.none() | text | st.lists(text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "cache_salt": st.none() | st.text(min_size=1, max_size=8),
}
JUNK: st.SearchStrategy[Any] = st.sampled_from(
    [-1, 0, 3, 1e9, -1e-300, "1", None, [], {}, True, 2**64]
)

content = text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                          min_size=1, max_size=3)  # fmt: skip
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": content},
    optional={"name": st.sampled_from(["bob", "x<|im_start|>"])},
)  # fmt: skip
prompt = (
    text
    | st.lists(st.integers(0, 258), min_size=1, max_size=20)
    | st.lists(text, min_size=1, max_size=3)
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    body = draw(st.fixed_dictionaries({}, optional=SAMPLING))
    if draw(st.sampled_from([False, False, False, True])):  # one parameter spoilt
        body[draw(st.sampled_from(sorted(SAMPLING)))] = draw(JUNK)
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(message, min_size=1, max_size=4))
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 20))
        return "/v1/chat/completions", body
    body["prompt"] = draw(prompt)
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 20))
    return "/v1/completions", body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-fuzz"), context_len=256)
    with live_server(model, scheduler=SchedulerConfig(max_running_requests=8)) as live:
        yield live


def _greedy(client: httpx.Client) -> list[int]:
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def test_random_requests_never_fail_the_server_or_a_neighbour(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        reference = _greedy(client)
    neighbour: list[list[int]] = []
    done = threading.Event()

    def keep_sending() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not done.is_set():
                neighbour.append(_greedy(client))

    thread = threading.Thread(target=keep_sending)
    thread.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            _fuzz(client)
    finally:
        done.set()
        thread.join(60)
    assert neighbour and all(ids == reference for ids in neighbour), (reference, neighbour)
    cache = server.wait_idle()
    assert cache["idle"] and cache["accounting_ok"] and cache["integrity"] == "ok", cache


def _fuzz(client: httpx.Client) -> None:
    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(requests())
    def one(request: tuple[str, dict[str, Any]]) -> None:
        path, body = request
        response = client.post(path, json=body)
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and set(error) == {"message", "type", "param", "code"}
        elif body.get("stream"):
            for line in sse_lines(response.text):
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:]), (body, line)

    one()
