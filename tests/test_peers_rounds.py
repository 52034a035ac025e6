"""The peers runner's rounds (`benchmarks/peers/run.py --rounds N`): an engine's file keeps its
median round whole, readable as a one-round file, and the docs pair only the rounds of one
invocation when they divide radixlm by vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import load_script

REPO = Path(__file__).resolve().parent.parent
peers_run = load_script(REPO / "benchmarks" / "peers" / "run.py", "peers_run")
render_docs = load_script(REPO / "benchmarks" / "render_docs.py", "render_docs")


def one_round(index: int, tok_s: float) -> dict[str, Any]:
    """A round as _measure returns it, tagged by main."""
    summary = {"output_tok_s": tok_s, "ttft_p50_ms": 1000.0 + index, "ttft_p99_ms": 2000.0,
               "itl_p50_ms": 40.0, "cached_tokens": 88, "prompt_tokens": 100}  # fmt: skip
    return {
        "config": {"workload": "fewshot", "seed": 0},
        "summary": summary,
        "contention": {"other_busy_cores": index / 100},
        "requests": [],
        "host": {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2", "fma"], "commit": "abc1234"},
        "round": {"index": index, "run_id": "R"},
        "started": f"2026-12-01T20:0{index}:00Z",
    }


def merged(tok_s: list[float], run_id: str = "R") -> dict[str, Any]:
    rounds = [one_round(i, t) for i, t in enumerate(tok_s)]
    return peers_run._merge_rounds(rounds, len(tok_s), run_id)


def test_the_file_is_the_median_round_whole_with_every_round_listed() -> None:
    result = merged([49.5, 47.7, 54.6, 48.3])
    # 47.7 < 48.3 < 49.5 < 54.6: an even count takes the lower middle round, round 3
    assert result["summary"]["output_tok_s"] == 48.3
    assert result["summary"]["ttft_p50_ms"] == 1003.0  # every field from that same round
    assert result["contention"]["other_busy_cores"] == 0.03
    assert result["config"]["summary_round"] == 3 and result["config"]["rounds_asked"] == 4
    assert result["config"]["seed"] == 0  # the client's config is kept
    assert [r["summary"]["output_tok_s"] for r in result["rounds"]] == [49.5, 47.7, 54.6, 48.3]
    assert "round" not in result and "started" not in result


def test_served_table_shows_the_median_and_each_rounds_ratio() -> None:
    runs = {
        ("radixlm", "served"): merged([49.5, 47.7, 54.6, 48.3]),
        ("vllm", "served"): merged([28.4, 28.9, 29.6, 24.8]),
        ("llama-server -np 1", "served"): merged([19.9], run_id="another"),
    }
    table = render_docs.served_table(runs)
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
    # per round 1.74 / 1.65 / 1.84 / 1.95: the median is the mean of the middle two
    assert " 1.79x " in rows["radixlm"]
    assert "49.5 (1.74x) · 47.7 (1.65x) · 54.6 (1.84x) · 48.3 (1.95x)" in rows["radixlm"]
    assert "28.4 · 28.9 · 29.6 · 24.8" in rows["vllm"]
    # not measured side by side with this vLLM: a plain ratio of the two files, marked
    assert "(separate run)" in rows["llama-server -np 1"]
    assert "4 rounds" in table
