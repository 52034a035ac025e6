"""`radixlm lint` from the command line: a file of chat bodies in, each miss with its reason,
position, the text on both sides and the fix out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_tokenizers import byte_level

from radixlm.cli import main

SYSTEM = "You are a helpful assistant. Answer briefly and cite your sources."


def write_bodies(path: Path) -> Path:
    bodies = [
        {"messages": [{"role": "system", "content": f"{stamp}\n{SYSTEM}"},
                      {"role": "user", "content": "Hi"}]}
        for stamp in ("Today is 2026-12-01.", "Today is 2026-12-02.")
    ]  # fmt: skip
    bodies.append(bodies[1])
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


def test_lint_prints_reason_position_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tok"
    byte_level().hf_tokenizer.save_pretrained(model)
    requests = write_bodies(tmp_path / "requests.jsonl")
    assert main(["lint", str(requests), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("line 2: volatile at token ") and "(messages[0].content)" in lines[0]
    assert "Today is 2026-12-0' | '2." in lines[1] and "Today is 2026-12-0' | '1." in lines[2]
    assert lines[3].startswith("    fix: move the changing value")
    assert "line 3" not in out  # the repeat is a hit
    assert lines[-1].startswith("3 requests,") and "hit 1" in lines[-1] and "volatile 1" in out

    assert main(["lint", str(requests), "--model", str(model), "--json"]) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["reason"] for r in reports] == ["new_content", "volatile", "hit"]
    assert reports[1]["before"].endswith("2026-12-0") and reports[1]["lost_tokens"] > 10
