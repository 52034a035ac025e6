"""One request must never hurt another: an error that belongs to one request (its
sampling, its detokenizer or stop checks) fails that request alone, the others finish with the
very tokens they get without it, and the slot account is back at idle."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import pytest
import torch
from engine_helpers import GREEDY, assert_idle, outputs, run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from radixlm.api_types import SamplingParams, StreamDelta
from radixlm.detokenizer import OutputStream, TextDelta
from radixlm.engine.async_engine import AsyncEngine
from radixlm.engine.engine import Engine
from radixlm.engine.request import Request
from radixlm.engine.sampler import SamplingState
from radixlm.engine.scheduler import SchedulerOutput
from radixlm.model.forward_batch import ForwardBatch

MAX_TOKENS = 10
PARAMS = [  # one per prompt: greedy, n = 2 (seeded forks), seeded sampling, greedy again
    replace(GREEDY, max_tokens=MAX_TOKENS),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
    replace(GREEDY, max_tokens=MAX_TOKENS),
]


def prompts() -> list[list[int]]:
    rng = random.Random(19)
    system = [rng.randrange(1, 250) for _ in range(30)]
    return [system + [rng.randrange(1, 250) for _ in range(n)] for n in (5, 17, 9, 40)]


@pytest.fixture(scope="module")
def reference(make_engine: Callable[..., Engine]) -> dict[int, list[list[int]]]:
    """chunk size -> every sample's tokens when nothing fails."""
    return {
        chunk: outputs(submit_and_run(make_engine(chunk_size=chunk), [])[0]) for chunk in (8, 512)
    }


class FaultySampling(SamplingState):
    """Raises inside the batched sampling call once its request has `fail_at` output tokens
    (its repetition penalty makes the sampler read `prompt_tensor`)."""

    def __init__(self, state: SamplingState, fail_at: int) -> None:
        params = replace(state.params, repetition_penalty=1.2)
        super().__init__(params, state.prompt_ids, state.output_ids, state.sample_index)
        self.fail_at = fail_at

    def prompt_tensor(self) -> torch.Tensor:
        if len(self.output_ids) >= self.fail_at:
            raise RuntimeError("injected sampling fault")
        return super().prompt_tensor()


def faulty_detokenizer(stream: OutputStream, fail_at: int) -> None:
    """Make the stream's push raise on the output's token number `fail_at`."""
    push = stream.push

    def fault(token_id: int) -> TextDelta:
        if len(stream.token_ids) >= fail_at:
            raise RuntimeError("injected detokenizer fault")
        return push(token_id)

    stream.push = fault  # type: ignore[method-assign]  # a fault injected for this test


class Fault(NamedTuple):
    prompt: int  # which request
    sample: int  # which of its samples
    stage: str  # "sampling", "detokenizing" or "logits" (its row of the model's output is NaN)
    fail_at: int  # raises once the sample has this many output tokens


ERROR_NAMES = {"sampling": "sampling", "detokenizing": "detokenizing", "logits": "NonFinite"}


def nan_logits(engine: Engine, targets: list[Fault], samples: list[list[Request]]) -> None:
    """Make the model's logits row of each target NaN once it has `fail_at` output tokens."""
    schedule, forward = engine.scheduler.schedule, engine.runner.forward
    plans: list[SchedulerOutput] = []

    def remember(*args: Any) -> SchedulerOutput:
        plans.append(schedule(*args))
        return plans[-1]

    def poisoned(batch: ForwardBatch) -> torch.Tensor:
        logits = forward(batch).clone()  # (R, V): one row per scheduled request, in order
        for row, item in enumerate(plans[-1].scheduled):
            for fault in targets:
                req = samples[fault.prompt][fault.sample]
                if item.req is req and len(req.output_ids) >= fault.fail_at:
                    logits[row] = math.nan
        return logits

    engine.scheduler.schedule = remember  # type: ignore[method-assign]  # notes each plan
    engine.runner.forward = poisoned  # type: ignore[method-assign]  # a fault injected for this test


def submit_and_run(
    engine: Engine, faults: list[Fault]
) -> tuple[list[list[Request]], list[StreamDelta]]:
    ids = [engine.add_request(p, params) for p, params in zip(prompts(), PARAMS, strict=True)]
    samples = [engine.requests(rid) for rid in ids]
    for fault in faults:
        req = samples[fault.prompt][fault.sample]
        if fault.stage == "sampling":
            req.sampling = FaultySampling(req.sampling, fault.fail_at)
        elif fault.stage == "detokenizing":
            faulty_detokenizer(req.output_stream, fault.fail_at)
    nan_logits(engine, [f for f in faults if f.stage == "logits"], samples)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert_idle(engine)
    return samples, deltas


def fault_lists() -> st.SearchStrategy[list[Fault]]:
    fault = st.builds(
        Fault,
        prompt=st.integers(0, len(PARAMS) - 1),
        sample=st.integers(0, 1),
        stage=st.sampled_from(["sampling", "detokenizing", "logits"]),
        fail_at=st.integers(0, MAX_TOKENS - 1),
    ).map(lambda f: f._replace(sample=min(f.sample, PARAMS[f.prompt].n - 1)))
    # a fork's first token comes from its leader's row: poison leaders' rows only
    fault = fault.map(lambda f: f._replace(sample=0) if f.stage == "logits" else f)
    return st.lists(fault, min_size=1, max_size=2, unique_by=lambda f: f.prompt)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(faults=fault_lists(), chunk=st.sampled_from([8, 512]))
@example(faults=[Fault(1, 1, "sampling", MAX_TOKENS - 1)], chunk=8)  # the leader ends first
@example(faults=[Fault(1, 0, "logits", 0), Fault(3, 0, "logits", 4)], chunk=8)
def test_a_fault_in_one_request_fails_it_alone(
    make_engine: Callable[..., Engine],
    reference: dict[int, list[list[int]]],
    faults: list[Fault],
    chunk: int,
) -> None:
    engine = make_engine(chunk_size=chunk)
    samples, deltas = submit_and_run(engine, faults)
    faulty = {f.prompt: f for f in faults}
    expected = iter(reference[chunk])
    for i, request in enumerate(samples):
        for req in request:
            tokens = next(expected)
            if i not in faulty:
                assert req.output_ids == tokens
                assert req.finish_reason == "length" and req.error is None
                continue
            if req.index == faulty[i].sample:  # fails at its `fail_at`
                assert req.finish_reason == "error"
                assert len(req.output_ids) == faulty[i].fail_at
            elif req.finish_reason == "length":  # a sibling that finished first, untouched
                assert req.output_ids == tokens and req.error is None
                continue
            # every unfinished sample of a faulty request fails with it
            assert req.finish_reason == "error"
            assert req.error is not None and ERROR_NAMES[faulty[i].stage] in req.error
    failed = sorted(d.request_id for d in deltas if d.finish_reason == "error")
    expected_failed = [r.rid for i in faulty for r in samples[i] if r.finish_reason == "error"]
    assert failed == sorted(expected_failed)
    assert engine.stats.aborted_requests == len(faults)
    # the engine goes on serving: a new batch gives the reference tokens
    assert outputs(run(engine, [prompts()[0]], PARAMS[0])) == [reference[chunk][0]]


def test_tiny_sampling_values_run_beside_the_others(
    make_engine: Callable[..., Engine], reference: dict[int, list[list[int]]]
) -> None:
    """top_p / temperature / repetition_penalty of 1e-300 run (they once failed every request
    in the batch with a 500), and the tiny temperature and top_p are greedy."""
    engine = make_engine()
    tiny = [
        SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1e-300, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(
            repetition_penalty=1e-300, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True
        ),
    ]
    prompt = prompts()[0]
    ids = [engine.add_request(p, params) for p, params in zip(prompts(), PARAMS, strict=True)]
    ids += [engine.add_request(prompt, params) for params in tiny]
    samples = [engine.requests(rid) for rid in ids]
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
    assert all(r.finish_reason == "length" and r.error is None for s in samples for r in s)
    assert outputs(samples[: len(PARAMS)]) == reference[512]
    greedy = reference[512][0]  # PARAMS[0] is greedy on the same prompt
    assert outputs(samples[len(PARAMS) :][:2]) == [greedy, greedy]


def test_the_failing_stream_ends_with_an_error_and_the_others_finish(
    make_engine: Callable[..., Engine], reference: dict[int, list[list[int]]]
) -> None:
    """Through the AsyncEngine (the server's path): the faulty request's stream ends with an
    error delta, every other stream finishes with its reference tokens."""

    def build() -> Engine:
        engine = make_engine()
        add = engine.add_request

        def add_with_fault(*args: Any, **kwargs: Any) -> str:
            rid = add(*args, **kwargs)
            if rid == "faulty":
                faulty_detokenizer(engine.requests(rid)[0].output_stream, fail_at=3)
            return rid

        engine.add_request = add_with_fault  # type: ignore[method-assign]  # a fault injected for this test
        return engine

    async def collect(rid: str, prompt: list[int], params: SamplingParams) -> list[StreamDelta]:
        return [d async for d in async_engine.generate(prompt, params, request_id=rid)]

    async def serve() -> list[list[StreamDelta]]:
        names = ["faulty" if i == 3 else f"ok-{i}" for i in range(len(PARAMS))]
        streams = [collect(n, p, s) for n, p, s in zip(names, prompts(), PARAMS, strict=True)]
        results = await asyncio.gather(*streams)
        await async_engine.call(assert_idle)
        return results

    async_engine = AsyncEngine(build)
    async_engine.start()
    try:
        streams = asyncio.run(serve())
    finally:
        async_engine.shutdown()
    expected = iter(reference[512])  # every sample's tokens, in prompt order
    for i, (deltas, params) in enumerate(zip(streams, PARAMS, strict=True)):
        ends = [d for d in deltas if d.finish_reason is not None]
        assert len(ends) == params.n
        references = [next(expected) for _ in range(params.n)]
        if i == 3:  # the faulty one: three tokens, then its error
            assert [(d.finish_reason, d.error is not None) for d in ends] == [("error", True)]
            assert [t for d in deltas for t in d.token_ids] == references[0][:3]
            continue
        assert all(d.finish_reason == "length" and d.error is None for d in ends)
        for index in range(params.n):
            got = [t for d in deltas if d.index == index for t in d.token_ids]
            assert got == references[index]


def test_a_failed_forward_pass_through_the_async_engine_spares_the_rest(
    make_engine: Callable[..., Engine], reference: dict[int, list[list[int]]]
) -> None:
    """A forward pass that raises fails the requests in it; one waiting outside it (the running
    cap is 1) still finishes with its reference tokens."""

    def build() -> Engine:
        engine = make_engine(max_running_requests=1)
        forward = engine.runner.forward

        def broken_for_the_first(batch: ForwardBatch) -> torch.Tensor:
            if engine.scheduler.running[0].rid == "first":
                raise RuntimeError("injected forward fault")
            return forward(batch)

        engine.runner.forward = broken_for_the_first  # type: ignore[method-assign]  # a fault injected for this test
        return engine

    async def collect(rid: str, prompt: list[int]) -> list[StreamDelta]:
        return [d async for d in async_engine.generate(prompt, PARAMS[0], request_id=rid)]

    async def serve() -> list[list[StreamDelta]]:
        results = await asyncio.gather(
            collect("first", prompts()[3]), collect("second", prompts()[0])
        )
        await async_engine.call(assert_idle)
        return list(results)

    async_engine = AsyncEngine(build)
    async_engine.start()
    try:
        first, second = asyncio.run(serve())
    finally:
        async_engine.shutdown()
    assert [(d.finish_reason, d.token_ids) for d in first] == [("error", [])]
    assert first[0].error is not None and "forward pass" in first[0].error
    assert [t for d in second for t in d.token_ids] == reference[512][0]
    assert second[-1].finish_reason == "length"
