"""Synthetic traces of other shapes for `bench cache`, and the benchmark that replays them: a
request that continues another arrives after it and extends its whole sequence, every length
is a multiple of 64 tokens (Belady's grain), the same seed gives the same trace, and each
trace's runs keep their orderings (more RAM never hits less)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

from radixlm.bench import trace_shapes
from radixlm.bench.trace_shapes import SHAPES, shape_trace

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
cache_traces = load_script(BENCHMARKS / "cache_traces.py", "cache_traces")
run_trace, shape_capacities = cache_traces.run_trace, cache_traces.shape_capacities


@pytest.fixture
def small_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape with a handful of families instead of hundreds."""
    small = {
        name: shape._replace(copies=3, more=tuple((2, p) for _, p in shape.more))
        for name, shape in SHAPES.items()
    }
    monkeypatch.setattr(trace_shapes, "SHAPES", small)


@pytest.mark.usefixtures("small_shapes")
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_trace_arrives_in_an_order_its_continuations_can_follow(name: str) -> None:
    trace = shape_trace(name, seed=3)
    assert [r.full.tolist() for r in trace] == [r.full.tolist() for r in shape_trace(name, 3)]
    assert [r.full.tolist() for r in trace] != [r.full.tolist() for r in shape_trace(name, 4)]
    continuations = 0
    for i, request in enumerate(trace):
        assert request.prompt_len % 64 == 0 and len(request.full) % 64 == 0
        extends = [
            j for j, other in enumerate(trace)
            if len(other.full) <= request.prompt_len
            and np.array_equal(request.full[: len(other.full)], other.full)
        ]  # fmt: skip
        assert all(j < i for j in extends)  # never before the request it continues
        continuations += bool(extends)
    assert (continuations > 0) == (SHAPES[name].workload in ("multiturn", "agent", "tot"))
    outputs = [r.full[r.prompt_len :] for r in trace]
    assert len(np.unique(np.concatenate(outputs))) == sum(map(len, outputs))  # fresh ids


@pytest.mark.usefixtures("small_shapes")
def test_continuations_come_back_after_other_traffic() -> None:
    trace = shape_trace("chat")
    firsts = [r.full[:64].tobytes() for r in trace]
    returns = [i for i in range(1, len(trace)) if firsts[i] in firsts[:i]]
    assert returns and any(firsts[i - 1] != firsts[i] for i in returns)  # interleaved


@pytest.mark.usefixtures("small_shapes")
def test_a_trace_report_holds_its_orderings() -> None:
    requests = shape_trace("agent")
    ram, disk = shape_capacities(requests)
    assert disk == 12 * ram and ram >= 32 * max(r.prompt_len for r in requests)
    report = run_trace("agent", requests, ram // 8, disk // 8, 64, tuned=False)
    runs, tiered = report["runs"], report["tiered"]
    assert set(runs) == {"belady", "lru", "turn-credit", "gdsf", "adaptive", "lru_ram_and_disk"}
    assert runs["lru_ram_and_disk"] >= runs["lru"] and runs["belady"] >= runs["lru"]
    assert tiered["all"]["hit_rate"] >= runs["lru"]
    assert set(tiered) == {"filter", "pressure", "all"}
