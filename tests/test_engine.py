"""The engine end to end on a tiny random model: outputs never depend on the cache, the batch,
the chunking or memory pressure, and every scenario ends with the slot account back at idle."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from engine_helpers import GREEDY, assert_idle, outputs, run

from radixlm.api_types import RequestOutput, SamplingParams
from radixlm.engine.engine import Engine, ForwardError
from radixlm.engine.request import request_output
from radixlm.model.forward_batch import ForwardBatch


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Three groups sharing a system prompt each, plus exact duplicates and a prefix of another."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(n)] for n in (40, 90, 7)]
    prompts = [s + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 30))] for s in systems]
    prompts += [s + [rng.randrange(1, 250) for _ in range(5)] for s in systems]
    prompts += [prompts[0], prompts[1][:50], [5]]
    return prompts


# The pools the identity tests run on: the model's float32, and int8 codes with scales, whose
# K/V is quantized the same way whether it is cached or recomputed.
KV_DTYPES = pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["f32-kv", "int8-kv"])


@KV_DTYPES
def test_greedy_outputs_do_not_depend_on_the_cache(
    make_engine: Callable[..., Engine], kv_dtype: str | None
) -> None:
    prompts = shared_prefix_prompts()
    reference = outputs(run(make_engine(cache="none", kv_dtype=kv_dtype), prompts))
    radix = make_engine(cache="radix", kv_dtype=kv_dtype)
    assert outputs(run(radix, prompts)) == reference
    # Again on the warm tree: now most prompts are cache hits, outputs must not move.
    warm = run(radix, prompts)
    assert outputs(warm) == reference
    # every prompt is in the tree now: all but its last token (whose logits are needed) hit
    assert [s[0].cache_hit_len for s in warm] == [len(p) - 1 for p in prompts]


@KV_DTYPES
def test_chunked_batched_and_alone_agree(
    make_engine: Callable[..., Engine], kv_dtype: str | None
) -> None:
    prompts = shared_prefix_prompts(1)
    reference = outputs(run(make_engine(kv_dtype=kv_dtype), prompts))
    chunked = make_engine(chunk_size=7, max_batch_tokens=16, kv_dtype=kv_dtype)
    assert outputs(run(chunked, prompts)) == reference
    alone = []
    for p in prompts:
        alone += outputs(run(make_engine(cache="none", kv_dtype=kv_dtype), [p]))
    assert alone == reference


@KV_DTYPES
def test_pool_pressure_evicts_and_retracts_without_changing_outputs(
    make_engine: Callable[..., Engine], kv_dtype: str | None
) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = outputs(run(make_engine(cache="none", kv_dtype=kv_dtype), prompts, params))
    tight = make_engine(num_slots=160, max_running_requests=8, kv_dtype=kv_dtype)
    assert outputs(run(tight, prompts, params)) == reference
    assert tight.scheduler.num_retractions > 0
    assert tight.cache.stats().evicted_tokens > 0


def test_prefill_of_a_fully_cached_prompt_recomputes_only_its_last_token(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    prompt = list(range(1, 81))
    first = run(engine, [prompt])
    before = engine.stats.prefill_tokens
    second = run(engine, [prompt])
    assert engine.stats.prefill_tokens - before == 1
    assert second[0][0].cache_hit_len == len(prompt) - 1
    assert outputs(first) == outputs(second)


def test_in_batch_sharing_prefills_a_new_common_prefix_once(
    make_engine: Callable[..., Engine],
) -> None:
    rng = random.Random(3)
    system = [rng.randrange(1, 250) for _ in range(200)]
    firsts = rng.sample(range(1, 250), 8)
    prompts = [system + [f] + [rng.randrange(1, 250) for _ in range(9)] for f in firsts]
    engine = make_engine(chunk_size=64)
    run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert engine.stats.prefill_tokens == len(system) + 8 * 10  # every distinct token once


def test_n_samples_share_one_prefill(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    prompt = list(range(10, 110))
    params = SamplingParams(temperature=1.0, max_tokens=10, n=4, seed=7, ignore_eos=True)
    samples = run(engine, [prompt], params)[0]
    assert engine.stats.prefill_tokens == len(prompt)
    assert [r.index for r in samples] == [0, 1, 2, 3]
    assert len({tuple(r.output_ids) for r in samples}) > 1  # the forks sample independently
    again = run(make_engine(cache="none"), [prompt], params)[0]
    assert [r.output_ids for r in again] == [r.output_ids for r in samples]  # seeded


def test_seeded_sampling_is_reproducible_whatever_the_batch(
    make_engine: Callable[..., Engine],
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=123)
    prompt = [7, 8, 9, 10, 11]
    alone = outputs(run(make_engine(), [prompt], params))
    crowd = [list(range(20 + i, 40 + i)) for i in range(5)]
    together = run(make_engine(), [*crowd, prompt], params)
    assert outputs([together[-1]]) == alone


def test_stop_string_spanning_tokens_ends_the_output_before_it(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    prompt = list(b"The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    full = _generate(engine, prompt, params)
    text = full.text
    assert len(text) >= 8, text
    stop = text[3:6]  # three bytes: three tokens of the byte-level tokenizer
    cut = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text


def test_errors_name_the_problem(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(num_slots=256)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 99999], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 1020, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="KV slots"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=10))
    engine.add_request([1, 2], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], GREEDY, request_id="dup")
    engine.abort("dup")
    assert_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "mid-decode"])
def test_abort_at_any_stage_returns_every_slot(
    make_engine: Callable[..., Engine], when: str, page_size: int
) -> None:
    engine = make_engine(page_size=page_size, chunk_size=8, max_batch_tokens=8)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=30, n=2, ignore_eos=True)
    other = engine.requests(engine.add_request(list(range(50, 70)), params))
    rid = engine.add_request(prompt, params)
    target = engine.requests(rid)[0]
    steps = {"waiting": 0, "mid-prefill": 3, "mid-decode": 12}[when]
    for _ in range(steps):
        engine.step()
    if when == "mid-prefill":
        assert 0 < target.computed_len < len(prompt)
    if when == "mid-decode":
        assert target.output_ids
    deltas = engine.abort(rid)
    assert {d.finish_reason for d in deltas} == {"abort"}
    assert len(deltas) == 2  # both samples
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
    # the other request never noticed: it finishes as it does alone
    assert [r.finish_reason for r in other] == ["length", "length"]
    alone = run(make_engine(page_size=page_size), [list(range(50, 70))], params)
    assert outputs([other]) == outputs(alone)


def test_no_cache_computes_every_prompt_token(make_engine: Callable[..., Engine]) -> None:
    prompts = shared_prefix_prompts()
    engine = make_engine(cache="none")
    run(engine, prompts)
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)
    assert engine.stats.cached_prompt_tokens == 0


def test_lpm_admits_the_longest_cached_prefix_first(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_running_requests=1)
    hot = list(range(100, 160))
    run(engine, [hot])  # now in the tree
    cold = engine.add_request(list(range(1, 40)), GREEDY)
    warm = engine.add_request([*hot, 1, 2], GREEDY)
    engine.step()
    running = [r.rid for r in engine.scheduler.running]
    assert running == [warm]
    engine.abort(cold)
    engine.abort(warm)
    assert_idle(engine)


@pytest.mark.parametrize("max_wait_steps", [3, 10_000])
def test_lpm_age_bound_lets_a_cold_request_through(
    make_engine: Callable[..., Engine], max_wait_steps: int
) -> None:
    """A stream of hot requests always wins on prefix length: without the age bound (10,000
    steps) the cold one starves until the stream runs dry; with it (3), it goes before most."""
    engine = make_engine(max_running_requests=1, max_wait_steps=max_wait_steps)
    hot = list(range(100, 160))
    run(engine, [hot])
    short = SamplingParams(temperature=0, max_tokens=2)
    cold = engine.requests(engine.add_request(list(range(1, 40)), short))[0]
    hot_stream = [engine.requests(engine.add_request([*hot, i + 1], short))[0] for i in range(20)]
    while cold.first_scheduled_time is None:
        engine.step()
    hot_before = sum(r.first_scheduled_time is not None for r in hot_stream)
    if max_wait_steps == 3:
        assert hot_before <= 3  # admitted long before the hot stream ran dry
    else:
        assert hot_before == len(hot_stream)  # the starvation the age bound exists to end
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)


def _generate(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = engine.add_request(prompt, params)
    samples = engine.requests(rid)
    while engine.has_unfinished():
        engine.step()
    return request_output(rid, samples)


def test_a_failed_forward_pass_fails_its_requests_and_no_other(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(chunk_size=16, max_batch_tokens=32, max_running_requests=2)
    prompts = [list(range(10 + i, 50 + i)) for i in range(3)]
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    waiting = engine.requests(rids[2])[0]  # max_running_requests keeps it out of the pass
    forward, calls = engine.runner.forward, []

    def flaky(batch: ForwardBatch) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(ForwardError) as failure:
        for _ in range(5):
            engine.step()
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert sorted(failure.value.request_ids) == rids[:2]
    deltas = engine.fail(failure.value.request_ids, "internal error")
    assert sorted(d.request_id for d in deltas) == rids[:2]
    assert {d.finish_reason for d in deltas} == {"error"}
    while engine.has_unfinished():  # the request outside the pass goes on
        engine.step()
    assert_idle(engine)
    assert waiting.finish_reason == "length"
    assert [waiting.output_ids] == outputs(run(make_engine(), [prompts[2]]))
