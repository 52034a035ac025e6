"""Speculation through the server: drafted and accepted tokens in each response's usage (the
`speculation` extension) and per draft source in /metrics; absent when speculation is off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.config import SchedulerConfig

# A prompt that repeats itself: its own tokens give drafts
PROMPT = "alpha beta gamma delta epsilon zeta eta theta; alpha beta gamma delta"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("spec-server"))


@pytest.fixture(scope="module")
def speculating(model: Path) -> Iterator[LiveServer]:
    with live_server(model, scheduler=SchedulerConfig(speculate="tree")) as live:
        yield live


def completion(server: LiveServer, stream: bool = False) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return dict(response.json())
    import json

    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    return dict(events[-1])


def test_usage_reports_drafted_and_accepted_tokens(speculating: LiveServer) -> None:
    for stream in (False, True):
        usage = completion(speculating, stream)["usage"]
        spec = usage["speculation"]
        assert spec["drafted_tokens"] > 0, usage
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        assert usage["completion_tokens"] == 24
    assert speculating.wait_idle()["idle"]


def test_metrics_count_draft_tokens_by_source(speculating: LiveServer) -> None:
    completion(speculating)
    text = speculating.get("/metrics").text
    drafted = {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("radixlm_spec_draft_tokens_total{")
    }
    assert set(drafted) == {"grammar", "prompt", "tree"}
    assert drafted["prompt"] + drafted["tree"] > 0
    assert any(line.startswith("radixlm_spec_accepted_tokens_total{") for line in text.splitlines())
    assert any(line.startswith("radixlm_output_tokens_total ") for line in text.splitlines())


def test_no_speculation_field_when_it_is_off(model: Path) -> None:
    with live_server(model, scheduler=SchedulerConfig(speculate="off")) as server:
        assert "speculation" not in completion(server)["usage"]
        assert "radixlm_spec_draft_tokens" not in server.get("/metrics").text
