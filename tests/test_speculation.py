"""Speculative decoding in the engine: drafts verified in the decode step change no output.

- Greedy output is token for token the same with speculation on and off, alone and batched,
  with the cache on and off, at page sizes 1 and 4, on every kernel variant this CPU executes
  (the test model's matmuls all go through skinny_linear, so verify rows are exact: its LM head
  has 272 rows, a multiple of 16).
- Seeded sampled output is the same too (one uniform per emitted token either way), and
  unseeded sampling keeps the model's distribution (tests/test_speculation_sampling.py).
- Every slot is accounted for after every step, with aborts and memory pressure (a property
  test); draft tokens count in the token budget; drafts use free slots only.
- Drafts come from the request's own tokens or from the tree of its own namespace, never from
  another tenant's; a request with nothing to copy drafts nothing.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_helpers import assert_idle, new_engine, outputs, run, steady_drafts
from helpers import save_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv_ownership import kv_writers  # noqa: F401  (a fixture)
from test_native_kernel import ISAS, require_native_kernels

from radixlm.api_types import SamplingParams
from radixlm.engine.engine import Engine
from radixlm.engine.scheduler import SchedulerOutput
from radixlm.engine.speculate import (
    NEIGHBOUR_SLOWDOWN,
    Draft,
    Proposal,
    Speculator,
    StepCost,
)
from radixlm.model.verify_rows import UNBOUNDED

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' model with a 272-row vocabulary (every matmul skinny: exact rows)."""
    path = tmp_path_factory.mktemp("spec-model")
    save_tiny_model("llama-gqa-llama3rope", path, vocab_size=272, max_position_embeddings=1024)
    return path


@pytest.fixture
def engine_for(spec_model: Path) -> Callable[..., Engine]:
    def make(**options: Any) -> Engine:
        return steady_drafts(new_engine(spec_model, **options))

    return make


def copying_prompts(seed: int, count: int, shared: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so drafts find continuations), optionally on a shared
    system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(shared)]
    prompts = []
    for _ in range(count):
        body = [rng.randrange(1, 250) for _ in range(rng.randrange(20, 40))]
        prompts.append(system + body + body[: rng.randrange(4, 12)])
    return prompts


def test_speculation_drafts_and_accepts_on_copying_prompts(
    engine_for: Callable[..., Engine],
) -> None:
    """The premise of the identity tests below: with speculation on, drafts are verified, some
    accepted, and the same tokens take fewer decode steps of a request."""
    prompts = copying_prompts(1, 4)
    off = engine_for(speculate="off")
    on = engine_for(speculate="auto")
    assert on.speculator.enabled and not off.speculator.enabled
    assert outputs(run(on, prompts, GREEDY)) == outputs(run(off, prompts, GREEDY))
    assert on.stats.draft_tokens > 0 and on.stats.accepted_tokens > 0
    assert off.stats.draft_tokens == 0
    assert on.stats.output_tokens == off.stats.output_tokens == 4 * GREEDY.max_tokens
    assert on.stats.decode_tokens == off.stats.decode_tokens - on.stats.accepted_tokens


@pytest.fixture(params=ISAS, ids=[f"isa-{i}" for i in ISAS])
def isa(request, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RADIXLM_ISA", request.param)
    require_native_kernels(request.param)
    return str(request.param)


@pytest.mark.parametrize("cache", ["radix", "none"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_output_is_identical_with_speculation_on_and_off(
    engine_for: Callable[..., Engine], isa: str, cache: str, page_size: int
) -> None:
    """Batched (8 requests on a shared prefix, in small chunks) and alone."""
    prompts = copying_prompts(2, 8, shared=40)
    options = {"cache": cache, "page_size": page_size, "chunk_size": 16}
    reference = outputs(run(engine_for(speculate="off", **options), prompts, GREEDY))
    on = engine_for(speculate="auto", **options)
    assert on.runner.kernels_isa == isa
    assert outputs(run(on, prompts, GREEDY)) == reference
    assert on.stats.accepted_tokens > 0
    for prompt, expected in zip(prompts[:3], reference[:3]):
        assert outputs(run(engine_for(speculate="auto", **options), [prompt], GREEDY)) == [expected]


def test_seeded_sampling_is_identical_with_speculation_on_and_off(
    engine_for: Callable[..., Engine],
) -> None:
    """A low temperature, so that some drafts are accepted and some rejected."""
    prompts = copying_prompts(3, 6)
    params = SamplingParams(temperature=0.1, top_k=40, max_tokens=30, seed=11, ignore_eos=True)
    reference = outputs(run(engine_for(speculate="off"), prompts, params))
    on = engine_for(speculate="auto")
    assert outputs(run(on, prompts, params)) == reference
    assert 0 < on.stats.accepted_tokens < on.stats.draft_tokens


def test_a_request_with_nothing_to_copy_drafts_nothing(engine_for: Callable[..., Engine]) -> None:
    """No token run of the prompt recurs and the tree is empty: a plain decode every step (the
    model's own output may still repeat itself, so only the first steps are checked)."""
    rng = random.Random(4)
    prompt = rng.sample(range(1, 250), 60)  # no token twice: no run of 3 recurs
    engine = engine_for(speculate="auto")
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.draft_tokens == 0
    assert_idle(engine)


def test_draft_tokens_count_in_the_token_budget(engine_for: Callable[..., Engine]) -> None:
    engine = engine_for(speculate="auto", max_batch_tokens=10)
    plans = record_plans(engine)
    prompts = copying_prompts(5, 6)
    run(engine, prompts, GREEDY)
    assert engine.stats.draft_tokens > 0
    assert all(sum(s.num_tokens for s in plan.scheduled) <= 10 for plan in plans)
    assert any(s.draft is not None for plan in plans for s in plan.scheduled)


def test_drafts_take_free_slots_only(engine_for: Callable[..., Engine]) -> None:
    """A pool with no free slot beyond what decoding needs: no draft evicts the cache."""
    engine = engine_for(speculate="auto", num_slots=130)
    plans = record_plans(engine)
    prompts = copying_prompts(6, 3)
    before: list[int] = []
    original = engine.scheduler._draft

    def draft(out: SchedulerOutput) -> None:
        before.append(engine.cache.num_free)
        original(out)

    engine.scheduler._draft = draft  # type: ignore[method-assign]
    run(engine, prompts, GREEDY)
    for free, plan in zip(before, plans):
        drafted = sum(s.num_tokens - s.extend_len for s in plan.scheduled)
        assert drafted <= free


def test_tree_drafts_stay_inside_their_namespace(engine_for: Callable[..., Engine]) -> None:
    """A finished request's output is in the tree: the same prompt again drafts it from the
    tree in the same namespace, and under another namespace finds nothing there."""
    rng = random.Random(7)
    prompt = rng.sample(range(1, 250), 50)  # nothing to copy from itself
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = engine_for(speculate="auto")
    first = engine.requests(engine.add_request(prompt, params, namespace="alice"))
    drain(engine)
    assert engine.speculator.drafted["tree"] == 0
    other = engine.requests(engine.add_request(prompt, params, namespace="bob"))
    drain(engine)
    assert engine.speculator.drafted["tree"] == 0  # bob's tree holds nothing of alice's
    again = engine.requests(engine.add_request(prompt, params, namespace="alice"))
    drain(engine)
    # her own output, drafted from the tree and all accepted (greedy: the same tokens again)
    assert engine.speculator.accepted["tree"] == engine.speculator.drafted["tree"] >= 10
    assert first[0].output_ids == other[0].output_ids == again[0].output_ids
    assert again[0].speculation is not None and again[0].speculation.accepted > 0
    assert_idle(engine)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 10_000),
    num_slots=st.sampled_from([150, 400, 4096]),
    page_size=st.sampled_from([1, 4]),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7)), max_size=4),
    temperature=st.sampled_from([0.0, 0.1]),
)
def test_every_slot_is_accounted_for_after_every_step(
    engine_for: Callable[..., Engine],
    seed: int,
    num_slots: int,
    page_size: int,
    aborts: list[tuple[int, int]],
    temperature: float,
) -> None:
    """Random copying workloads with speculation on, aborts at random steps, pools small
    enough to evict and retract: after every step the tree's invariants and the slot account
    hold, no draft slot outlives its step, and in-flight slots are exactly what the running
    requests hold."""
    engine = engine_for(
        speculate="auto", num_slots=num_slots, page_size=page_size, chunk_size=16,
        max_batch_tokens=48,
    )  # fmt: skip
    params = SamplingParams(temperature=temperature, max_tokens=20, seed=seed, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in copying_prompts(seed, 8, shared=16)]
    for step in range(400):
        for when, which in aborts:
            if when == step:
                engine.abort(ids[which])
        if not engine.has_unfinished():
            break
        engine.step()
        engine.cache.check_integrity()
        running = engine.scheduler.running
        assert all(len(r.draft_slots) == 0 for r in running)
        held = sum(len(r.slots) - r.cached_len for r in running)
        assert engine.cache.num_in_flight == held
    assert not engine.has_unfinished()
    assert_idle(engine)


def test_only_the_scheduler_moves_draft_slots(
    engine_for: Callable[..., Engine],
    kv_writers: Counter[str],  # noqa: F811
) -> None:
    """Drafts accepted and rejected, under memory pressure (retractions) and an abort: every
    write of a request's KV fields, draft_slots included, is the scheduler's."""
    engine = engine_for(speculate="auto", num_slots=160, chunk_size=8)
    prompts = copying_prompts(8, 8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rid = engine.add_request(prompts[0], params)
    while len(engine.requests(rid)[0].output_ids) < 3:
        engine.step()
    engine.abort(rid)
    run(engine, prompts[1:], params)
    assert engine.stats.accepted_tokens > 0 and engine.scheduler.num_retractions > 0
    assert {w.split(":")[0] for w in kv_writers} == {"scheduler.py"}, kv_writers
    functions = {w.split(":")[1] for w in kv_writers}
    assert {"postprocess", "accept_draft", "end_verify", "_drop_kv"} <= functions


def record_plans(engine: Engine) -> list[SchedulerOutput]:
    plans: list[SchedulerOutput] = []
    original = engine.scheduler.schedule

    def schedule() -> SchedulerOutput:
        plan = original()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return plans


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_choose_drafts_long_alone_and_short_in_a_large_batch() -> None:
    """The marginal rule: a lone request that copies well verifies a long draft, a large
    batch at the same rate only a short one each, a failing request none; forced tokens
    (rate 1) always fit, up to the room left."""
    spec = Speculator("tree", None, exact_rows=UNBOUNDED)
    spec.cost = StepCost(fixed=0.15)
    draft = Draft(tuple(range(16)), "prompt")

    def lengths(rates: list[float], rows: int, room: int = 1000) -> list[int]:
        proposals = [Proposal(SimpleNamespace(speculation=None), draft, r) for r in rates]  # type: ignore[arg-type]
        return [len(d.tokens) if d else 0 for d in spec.choose(proposals, rows, room)]

    assert lengths([0.95], rows=1)[0] >= 12
    alone = lengths([0.7], rows=1)[0]
    crowd = lengths([0.7] * 16, rows=16)
    assert 2 <= alone <= 8 and max(crowd) < alone
    assert lengths([0.1], rows=1) == [0]
    assert lengths([1.0, 1.0], rows=2, room=20) == [10, 10]


def test_drafts_beside_a_neighbour_slow_its_step_by_at_most_half() -> None:
    """A step that also carries a request without a draft: its draft rows may raise the step's
    cost (1 + r n) by at most NEIGHBOUR_SLOWDOWN, however well the drafting request copies;
    alone, the same request drafts its whole run."""
    spec = Speculator("tree", None, exact_rows=UNBOUNDED)
    spec.cost = StepCost(fixed=0.15)
    draft = Draft(tuple(range(16)), "prompt")
    proposal = Proposal(SimpleNamespace(speculation=None), draft, 0.99)  # type: ignore[arg-type]
    [alone] = spec.choose([proposal], 1, 1000)
    assert alone is not None and len(alone.tokens) == 16
    [beside] = spec.choose([proposal], 2, 1000)  # its row and a neighbour's
    assert beside is not None and len(beside.tokens) >= 1
    assert 1 + 0.15 * (2 + len(beside.tokens)) <= NEIGHBOUR_SLOWDOWN * (1 + 0.15 * 2)


def test_the_row_cost_is_fitted_to_the_steps_timed() -> None:
    cost = StepCost()
    assert cost.row_cost == StepCost.PRIOR_ROW_COST
    for n in [1, 2, 4, 8, 16, 3, 5, 9] * 4:
        cost.observe(n, 0.010 + 0.002 * n)  # 10 ms fixed, 2 ms a row
    assert abs(cost.row_cost - 0.2) < 1e-6
