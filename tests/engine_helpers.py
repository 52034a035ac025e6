"""Helpers shared by the engine tests: a tiny model's engine, running prompts to the end, and the
idle check every scenario ends with (the slot account back at idle). conftest's `make_engine`
fixture builds engines on a model saved once per session."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers import save_tiny_model

from radixlm.api_types import SamplingParams
from radixlm.config import CacheConfig, CacheKind, KVDType, ModelConfig, SchedulerConfig
from radixlm.engine.engine import Engine
from radixlm.engine.request import Request
from radixlm.engine.speculate import StepCost

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def save_engine_model(path: Path) -> None:
    """The engine tests' model: tiny, random, GQA with llama3 rope, 1024 positions."""
    save_tiny_model("llama-gqa-llama3rope", path, max_position_embeddings=1024)


def new_engine(
    model_dir: Path,
    cache: CacheKind = "radix",
    num_slots: int = 4096,
    page_size: int = 1,
    kv_dtype: KVDType | None = None,
    **scheduler: Any,
) -> Engine:
    """An Engine on the model at `model_dir` (float32; its pool in `kv_dtype`, default the
    model's); `scheduler` holds SchedulerConfig fields."""
    cache_config = CacheConfig(
        num_slots=num_slots, page_size=page_size, cache=cache, kv_dtype=kv_dtype
    )
    return Engine(
        ModelConfig(path=str(model_dir), dtype="float32", num_threads=1),
        cache_config,
        SchedulerConfig(**scheduler),
    )


def steady_drafts(engine: Engine, row_cost: float = 0.1) -> Engine:
    """The engine with its speculator's row cost pinned (not fitted to this host's timings),
    so which drafts a step verifies does not depend on how busy the machine is."""
    engine.speculator.cost = StepCost(fixed=row_cost)
    return engine


def run(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY
) -> list[list[Request]]:
    """Submit all prompts at once and step until done; the samples of each request."""
    ids = [engine.add_request(p, params) for p in prompts]
    samples = [engine.requests(rid) for rid in ids]
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
    return samples


def outputs(samples: list[list[Request]]) -> list[list[int]]:
    return [r.output_ids for s in samples for r in s]


def assert_idle(engine: Engine) -> None:
    """No request holds anything: every slot is free or tree-owned, nothing is locked."""
    cache = engine.cache
    cache.check_integrity()
    assert cache.num_in_flight == 0
    assert cache.num_protected == 0
    assert cache.num_free + cache.num_tree_tokens == cache.capacity
    assert not engine.has_unfinished()
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
