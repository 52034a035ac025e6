"""A request's timeline: its stages add up to its time to first token, it is in the response
only when asked (JSON, a stream's last chunk, a list for a batch), every request's stages reach
/metrics, and it shows the caller nothing of the requests beside its own."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from engine_helpers import assert_idle
from helpers import sse_events
from live_server import LiveServer

from radixlm.api_types import SamplingParams
from radixlm.engine.engine import Engine
from radixlm.server.timeline import STAGES

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def _check(timeline: dict[str, Any], streamed: bool) -> None:
    """Every stage present, none negative, and together they are the whole."""
    assert set(timeline) == {"first_token_ms", "num_forwards", "stages_ms"}
    stages = timeline["stages_ms"]
    assert list(stages) == list(STAGES)
    assert (stages["write"] is not None) == streamed
    measured = [v for v in stages.values() if v is not None]
    assert all(v >= 0 for v in measured), stages
    assert math.isclose(sum(measured), timeline["first_token_ms"], abs_tol=0.02)
    assert timeline["num_forwards"] >= 1


@pytest.mark.usefixtures("client")  # the slot account idle after it
def test_a_json_answer_carries_its_timeline_when_asked(server: LiveServer) -> None:
    """`return_timeline` adds a top-level "timeline" (no write stage: a JSON answer is written
    once every token is in); without it the body is OpenAI's, with no such key."""
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    plain = server.post("/v1/chat/completions", json=body).json()
    assert "timeline" not in plain
    timed = server.post("/v1/chat/completions", json={**body, "return_timeline": True}).json()
    _check(timed["timeline"], streamed=False)
    assert timed["timeline"]["stages_ms"]["template"] > 0  # a chat renders its template
    assert timed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


@pytest.mark.usefixtures("client")  # the slot account idle after it
def test_a_stream_ends_with_its_timeline(server: LiveServer) -> None:
    """A stream's timeline is in a chunk with no choices just before [DONE] (the usage chunk
    when usage is asked for), after its first token's chunk was written."""
    body = {"prompt": "abc def", "max_tokens": 5, "stream": True, "return_timeline": True}
    events = sse_events(server.post("/v1/completions", json=body).text)
    assert all("timeline" not in e for e in events[:-1])
    assert events[-1]["choices"] == [] and "usage" not in events[-1]
    _check(events[-1]["timeline"], streamed=True)
    with_usage = {**body, "stream_options": {"include_usage": True}}
    events = sse_events(server.post("/v1/completions", json=with_usage).text)
    assert events[-1]["usage"]["completion_tokens"] == 5
    _check(events[-1]["timeline"], streamed=True)


@pytest.mark.usefixtures("client")  # the slot account idle after it
def test_a_batch_has_one_timeline_per_prompt(server: LiveServer) -> None:
    """A /v1/completions batch gets a list, one timeline per prompt (its first sample's)."""
    body = {"prompt": ["abc", "xyz", "012"], "max_tokens": 3, "n": 2, "return_timeline": True}
    timelines = server.post("/v1/completions", json=body).json()["timeline"]
    assert len(timelines) == 3
    for timeline in timelines:
        _check(timeline, streamed=False)


@pytest.mark.usefixtures("client")  # the slot account idle after it
def test_every_request_reaches_the_stage_histograms(server: LiveServer) -> None:
    """Each served prompt adds one observation to each stage's histogram, asked or not; the
    engine's forward seconds count up and never pass its step seconds."""
    before, engine_before = _metrics(server), server.cache()["engine_stats"]
    server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    server.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    after, engine_after = _metrics(server), server.cache()["engine_stats"]
    for stage in STAGES:
        key = f'radixlm_request_stage_seconds_count{{stage="{stage}"}}'
        assert after[key] - before.get(key, 0.0) == (1 if stage == "write" else 4), stage
    assert after["radixlm_engine_forward_seconds_total"] > 0  # the engine's, as of a snapshot
    assert engine_before["forward_s"] < engine_after["forward_s"] <= engine_after["step_s"]


@pytest.mark.usefixtures("client")  # the slot account idle after it
def test_a_timeline_shows_only_its_own_request(server: LiveServer) -> None:
    """Counted work in a timeline is the request's own: its forward passes are as many when it
    shares its steps with another tenant's long stream as when it runs alone."""
    body = {"prompt": "the same prompt, alone or not", "max_tokens": 3, "return_timeline": True}
    alone = server.post("/v1/completions", json={**body, "cache_salt": "a1"}).json()["timeline"]
    stop = threading.Event()

    def neighbour() -> None:  # another tenant streaming long outputs all the while
        while not stop.is_set():
            other = {"prompt": "another tenant", "max_tokens": 60, "cache_salt": "b"}
            server.post("/v1/completions", json={**other, "ignore_eos": True})

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        shared = server.post("/v1/completions", json={**body, "cache_salt": "a2"}).json()
    finally:
        stop.set()
        thread.join()
    assert shared["timeline"]["num_forwards"] == alone["num_forwards"] == 1
    assert set(shared["timeline"]) == set(alone)  # no other field appears with company


def test_the_engine_times_a_first_token_over_chunks(make_engine: Callable[..., Engine]) -> None:
    """The first token's delta carries the engine's part of the timeline, with one forward per
    prefill chunk; later deltas carry none; a retry on a cached prefix counts its one pass."""
    engine = make_engine(chunk_size=16, max_batch_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 41))  # 40 tokens: chunks of 16, 16, 8
    engine.add_request(prompt, params, "r")
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    firsts = [d.first_token for d in deltas if d.first_token is not None]
    assert len(firsts) == 1 and deltas[0].first_token is firsts[0]
    times = firsts[0]
    assert times.num_forwards == 3
    assert times.received <= times.scheduled <= times.sampled
    assert 0 < times.forward_s <= times.sampled - times.scheduled + 1e-9
    assert engine.stats.forward_s <= engine.stats.step_s
    engine.add_request(prompt, params, "again")  # 39 tokens cached: one pass
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert next(d.first_token for d in deltas if d.first_token).num_forwards == 1
    assert_idle(engine)


def _metrics(server: LiveServer) -> dict[str, float]:
    text = server.get("/metrics").text
    pattern = re.compile(r"^(radixlm_\S+) (\S+)$", re.M)
    return {name: float(value) for name, value in pattern.findall(text)}
