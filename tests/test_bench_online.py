"""`radixlm bench serve` against a live radixlm: dependent requests, hang-ups, no leaked slot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from live_server import live_server, save_tiny_chat_model

from radixlm.bench.online_client import RequestRecord, _read_chunk
from radixlm.cli import main

pytestmark = pytest.mark.timeout(180)


def test_bench_serve_with_disconnects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = save_tiny_chat_model(tmp_path / "model", context_len=512)
    out = tmp_path / "bench.json"
    with live_server(model) as server:
        argv = [
            "bench", "serve", "--base-url", server.url, "--workload", "multiturn",
            "--param", "num_conversations=6", "--param", "num_turns=3",
            "--param", "turn_len=16", "--param", "output_len=8",
            "--token-range", "3:256", "--concurrency", "4", "--disconnect-frac", "0.3",
            "--seed", "1", "--json", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
        cache = server.wait_idle()
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["num_requests"] == 18
    assert summary["num_errors"] == 0 and summary["num_5xx"] == 0, summary
    assert summary["num_disconnected"] > 0
    assert summary["num_ok"] + summary["num_disconnected"] == 18
    assert summary["cached_tokens"] > 0  # later turns extend earlier ones
    assert summary["leaked_slots"] == 0 and summary["accounting_ok"]
    assert summary["ideal_prefill_tokens"] > 0 and summary["server_prefill_tokens"] > 0
    assert summary["followup_ttft_p50_ms"] > 0 and summary["root_ttft_p50_ms"] > 0
    assert cache["idle"]
    assert "follow-up" in capsys.readouterr().out


def test_llama_server_token_ids_from_verbose_chunks() -> None:
    # llama-server's /v1/completions sends no token_ids; with "verbose": true each chunk carries
    # the token's id under "__verbose", and the final chunk an empty list.
    record = RequestRecord("0", prompt_len=3, max_tokens=2)
    chunks = [
        {"choices": [{"text": "a"}], "__verbose": {"tokens": [17]}},
        {"choices": [{"text": "b"}], "__verbose": {"tokens": [42]}},
        {"choices": [{"text": "", "finish_reason": "length"}], "__verbose": {"tokens": []},
         "usage": {"completion_tokens": 2}},
    ]  # fmt: skip
    assert [_read_chunk(c, record) for c in chunks] == [1, 1, 0]
    assert record.output_ids == [17, 42] and record.num_output_tokens == 2
