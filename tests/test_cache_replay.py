"""`radixlm bench cache`: trace parsing (both line forms, errors with line numbers), the replay
semantics on a tiny trace, and the JSON keys the issue promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixlm.bench.cache_replay import replay
from radixlm.bench.traces import TraceError, load_trace
from radixlm.cli import main

JSON_KEYS = {
    "requests", "requests_per_s", "prompt_tokens", "hit_tokens", "token_hit_rate",
    "match_p50_us", "match_p99_us", "insert_p50_us", "insert_p99_us", "evict_calls",
    "evict_p50_us", "evict_p99_us", "evicted_tokens", "capacity_tokens", "page_size",
}  # fmt: skip


def write(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_both_line_forms(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt": [5, 6, 7], "output": [8]}',
        "",
        '{"hash_ids": [0, 3], "input_length": 600, "output_length": 2}',
        '{"hash_ids": [0], "input_length": 10, "output_length": 1, "timestamp": 5}',
    )
    first, second, third = load_trace(path)
    assert first.prompt.tolist() == [5, 6, 7] and first.full.tolist() == [5, 6, 7, 8]
    assert second.prompt_len == 600 and second.prompt[511] == 511
    assert second.prompt[512] == 3 * 512 and second.prompt[-1] == 3 * 512 + 87
    fresh = set(second.full[600:].tolist()) | set(third.full[10:].tolist())
    assert len(fresh) == 3 and min(fresh) > 4 * 512  # outputs never collide with anything


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": [1, 2', "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"tokens": [1]}', "need a 'prompt'"),
        ('{"prompt": [1, 2.5]}', "list of integers"),
        ('{"prompt": [1, -2]}', "negative"),
        ('{"hash_ids": [1], "input_length": 513}', "exceeds"),
        ('{"hash_ids": [1], "input_length": -1}', "non-negative"),
    ],
)
def test_malformed_lines_name_the_line_and_the_problem(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = write(tmp_path, '{"prompt": [1]}', line)
    with pytest.raises(TraceError, match=rf"trace.jsonl:2: .*{problem}"):
        load_trace(path)


def test_replay_counts_hits_and_evicts_to_capacity(tmp_path: Path) -> None:
    shared = list(range(100, 110))
    path = write(
        tmp_path,
        json.dumps({"prompt": [*shared, 1], "output": [2, 3]}),
        json.dumps({"prompt": [*shared, 4], "output": [5]}),
        json.dumps({"prompt": [9, 9, 9], "output": []}),
    )
    requests = load_trace(path)
    unbounded = replay(requests).summary()
    assert unbounded["hit_tokens"] == 10 and unbounded["evict_calls"] == 0
    bounded = replay(requests, capacity=15, inflight=1).summary()
    # the third request needs 3 more: the first request's unlocked 3-token leaf goes
    assert bounded["evict_calls"] == 1 and bounded["evicted_tokens"] == 3
    assert bounded["final_cached_tokens"] == 15
    paged = replay(requests, page_size=4).summary()
    assert paged["hit_tokens"] == 8 and paged["final_cached_tokens"] == 12 + 4


def test_cli_writes_the_promised_json(tmp_path: Path) -> None:
    trace = write(tmp_path, *(json.dumps({"prompt": [1, 2, i], "output": [7]}) for i in range(9)))
    out = tmp_path / "out.json"
    args = ["bench", "cache", "--trace", trace, "--capacity", "12", "--inflight", "2"]
    assert main([*args, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert set(summary) >= JSON_KEYS and summary["requests"] == 9
    assert summary["token_hit_rate"] == round(16 / 27, 4)
    assert main(["bench", "cache", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("split an") == 2 and "Optimize this query" in shown
    assert "reused 62 of 127 prompt tokens" in " ".join(shown.split())
