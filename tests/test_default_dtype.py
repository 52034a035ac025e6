"""`--dtype auto`, the default: bfloat16 exactly where the native kernels have bfloat16 dot
products, float32 everywhere else; the engine loads what it resolves to, pool included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import GREEDY, assert_idle, outputs, run

from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig
from radixlm.engine.engine import Engine
from radixlm.model import native, native_build
from radixlm.model.backend import default_dtype


def test_auto_is_the_default_everywhere() -> None:
    assert ModelConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be auto"):
        ModelConfig(dtype="float64")  # type: ignore[arg-type]  # the bad value under test


@pytest.mark.parametrize("isa", [v.name for v in native_build.executable_variants()])
def test_auto_follows_the_variant_that_runs(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setenv("RADIXLM_ISA", isa)
    kernels = native.kernels_for(isa)
    bf16 = kernels is not None and kernels.bf16_dots
    assert default_dtype("cpu") == ("bfloat16" if bf16 else "float32")
    # the only variant with bfloat16 dot products is avx512, on a CPU that has them
    assert bf16 == (isa == "avx512" and "avx512_bf16" in native_build.cpu_flags())


def test_auto_is_float32_without_kernels_or_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_dtype("cuda:0") == "float32"
    monkeypatch.setenv("RADIXLM_NATIVE", "0")
    assert default_dtype("cpu") == "float32"


def test_an_auto_engine_runs_what_auto_resolves_to(engine_model_dir: Path) -> None:
    """The weights and the KV pool take the resolved dtype, and greedy output equals that of an
    engine given the same dtype by name."""
    resolved = default_dtype("cpu")
    engines = [
        Engine(
            ModelConfig(path=str(engine_model_dir), dtype=dtype, num_threads=1),
            CacheConfig(num_slots=2048),
            SchedulerConfig(),
        )
        for dtype in ("auto", resolved)
    ]
    auto = engines[0]
    assert auto.runner.dtype == resolved
    assert auto.runner.pool.dtype == getattr(torch, resolved)
    prompts = [list(range(3, 40)), [*range(3, 30), 7, 8, 9]]
    assert outputs(run(auto, prompts, GREEDY)) == outputs(run(engines[1], prompts, GREEDY))
    for engine in engines:
        assert_idle(engine)
