"""The terminal commands: flags built from the configs, `generate --json`, and `chat`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from live_server import save_tiny_chat_model

from radixlm.cli import build_parser, main
from radixlm.commands.options import engine_configs
from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-cli"), context_len=512)


def test_engine_flags_come_from_the_configs() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m.gguf", "--num-slots", "100", "--policy", "fcfs", "--port", "0"]
    )
    configs = engine_configs(args)
    assert configs.model == ModelConfig(path="m.gguf")
    assert configs.cache == CacheConfig(num_slots=100)
    assert configs.scheduler == SchedulerConfig(policy="fcfs")
    assert args.port == 0 and args.host is None  # left out: the ServerConfig default


def test_the_kv_dtype_flag_takes_int8() -> None:
    """--kv-dtype names the pool's storage: a float dtype or int8 (codes and scales); any
    other spelling is refused by argparse before anything loads."""
    args = build_parser().parse_args(["serve", "--kv-dtype", "int8"])
    assert engine_configs(args).cache == CacheConfig(kv_dtype="int8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-dtype", "q8_0"])


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "random"])  # not a choice
    args = build_parser().parse_args(["generate", "x", "--num-slots", "0"])
    with pytest.raises(ValueError, match="num_slots"):
        engine_configs(args)


def test_every_command_and_bench_parses() -> None:
    parser = build_parser()
    for argv in (["serve"], ["chat"], ["generate", "hi"], ["bench", "serve", "--base-url", "u"]):
        assert parser.parse_args(argv)


def test_generate_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "hello there", "--model", str(model), "--json", "--max-tokens", "5",
            "--temperature", "0", "--ignore-eos", "--num-slots", "2048"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 5 and isinstance(out["text"], str)
    assert out["prompt_token_ids"] == list(b"hello there")
    assert out["finish_reason"] == "length" and out["cached_tokens"] == 0


def test_chat_shows_cached_tokens_and_ttft(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = iter(["hello", "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", "--model", str(model), "--max-tokens", "4", "--temperature", "0",
            "--num-slots", "2048", "--system", "be brief"]  # fmt: skip
    assert main(argv) == 0
    status = [line for line in capsys.readouterr().err.splitlines() if "from the cache" in line]
    assert len(status) == 2 and all("TTFT" in line for line in status)
    cached = [int(line.split("[")[1].split("/")[0]) for line in status]
    assert cached[0] == 0 and cached[1] > 0  # the second turn reuses the first


def test_loading_reports_progress_per_stage(model: Path) -> None:
    from radixlm.engine.engine import Engine

    seen: dict[str, tuple[int, int]] = {}
    Engine(
        ModelConfig(path=str(model), dtype="float32", num_threads=1),
        CacheConfig(num_slots=256),
        progress=lambda stage, done, total: seen.__setitem__(stage, (done, total)),
    )
    # on CPU the native kernels are built (or found in the cache) at load, not at first request
    assert list(seen) == ["weights", "packing", "tokenizer", "KV pool", "native kernels"]
    assert all(done == total > 0 for done, total in seen.values()), seen
