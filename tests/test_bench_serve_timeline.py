"""`radixlm bench serve --timeline` and the follow-up workload against a live radixlm: each
request's timeline comes back and is summarized per stage, first turns and follow-ups apart; the
served efficiency is read from the server's engine counters; no slot leaks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from live_server import live_server, save_tiny_chat_model

from radixlm.bench.online_client import RequestRecord, _read_chunk
from radixlm.cli import main
from radixlm.server.timeline import STAGES

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("prompt_format", ["tokens", "chat"])
def test_followup_bench_reports_the_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], prompt_format: str
) -> None:
    """Follow-ups extend their whole history: few new tokens over many cached ones, each with
    a timeline of every stage; the engine's forward seconds are a share of the wall time."""
    model = save_tiny_chat_model(tmp_path / "model", context_len=1024)
    out = tmp_path / "bench.json"
    with live_server(model) as server:
        argv = [
            "bench", "serve", "--base-url", server.url, "--workload", "followup",
            "--param", "num_conversations=3", "--param", "history_len=40",
            "--param", "num_turns=2", "--param", "turn_len=2", "--param", "output_len=4",
            "--token-range", "3:256", "--concurrency", "2", "--prompt-format", prompt_format,
            "--timeline", "--json", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
        cache = server.wait_idle()
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_ok"] == 9 and summary["num_errors"] == 0, summary
    assert summary["leaked_slots"] == 0 and summary["accounting_ok"] and cache["idle"]
    followups = summary["followup_timeline"]
    assert followups["num_requests"] == 6 and summary["root_timeline"]["num_requests"] == 3
    assert set(followups["stages_ms"]) == set(STAGES)
    assert followups["num_forwards_p50"] == 1
    assert summary["followup_new_tokens_p50"] * 2 < summary["followup_cached_tokens_p50"]
    assert 0 < summary["served_efficiency"] <= summary["step_share"] <= 1
    printed = capsys.readouterr().out
    assert "served efficiency" in printed and "follow-ups: first token p50" in printed


def test_a_timeline_is_read_from_a_stream_s_last_chunk() -> None:
    """The client keeps the timeline the server put in the usage chunk."""
    record = RequestRecord("0", prompt_len=3, max_tokens=1)
    timeline = {"first_token_ms": 1.0, "num_forwards": 1, "stages_ms": {"body": 1.0}}
    chunks: list[dict[str, Any]] = [
        {"choices": [{"text": "a", "token_ids": [5]}]},
        {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3},
         "timeline": timeline},
    ]  # fmt: skip
    assert [_read_chunk(c, record) for c in chunks] == [1, 0]
    assert record.timeline == timeline and record.output_ids == [5]
