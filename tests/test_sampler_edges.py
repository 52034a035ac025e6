"""The sampler at the edges of what SamplingParams accepts: every value gives a valid token and
finite logprobs, penalties never reorder tokens, and the limits are the greedy choice (a tiny
temperature, a tiny top_p, top_k 1, min_p 1). The reproductions of past crashes come first."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.api_types import SamplingParams
from radixlm.engine.sampler import (
    NonFiniteLogitsError,
    SampledToken,
    Sampler,
    SamplingFailure,
    SamplingState,
    apply_logit_bias,
    apply_penalties,
)


def wide_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("top_p", [1e-300, 7e-46, 1e-46])
def test_a_tiny_top_p_keeps_the_top_token(top_p: float) -> None:
    # once: `index -1 is out of bounds` in _keep_top_p (top_p is 0.0 in float32)
    logits = wide_logits(4, 1000, seed=0)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    out = Sampler(seed=0).sample(logits, [SamplingState(params) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-37])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_tiny_temperature_is_the_greedy_choice(temperature: float, top_p: float) -> None:
    # once: token id 0 (the least likely) once logits / temperature overflowed to inf
    logits = wide_logits(4, 1000, seed=1, scale=20.0)  # maxima near 70: 70 / 1e-37 > float32
    params = SamplingParams(temperature=temperature, top_p=top_p)
    out = Sampler(seed=1).sample(logits, [SamplingState(params) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e300, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1.0])
def test_an_extreme_repetition_penalty_keeps_the_exact_order(
    penalty: float, temperature: float
) -> None:
    # once: repetition_penalty 1e-300 divided by 0.0 (inf logits, then a crash or token 0)
    logits = wide_logits(3, 64, seed=2)
    prompt = list(range(0, 64, 3))
    params = SamplingParams(temperature=temperature, top_p=0.9, repetition_penalty=penalty)
    states = [SamplingState(params, prompt_ids=prompt) for _ in range(3)]
    ours = apply_penalties(logits, states)
    assert bool(torch.isfinite(ours).all())
    for row in range(3):
        exact = exact_penalised(logits[row], params, prompt, [])
        assert_same_order(ours[row], dict(enumerate(exact)))
    if temperature < 1e-37:  # the greedy limit: the exact maximum (logits here have no ties)
        out = Sampler(seed=2).sample(logits, states)
        for row, token in enumerate(out.token_ids):
            exact = exact_penalised(logits[row], params, prompt, [])
            assert exact[token] == max(exact)


def test_a_huge_penalised_logit_does_not_blur_the_others_ranks() -> None:
    # found by the property test: a seen logit of 30 under repetition_penalty 1e-263 becomes
    # 3e31, and `scores - max` rounds every other score to -3e31, so top_k 8 (deciding on
    # shifted scores) kept all 38 tokens; the filters now decide on the scores themselves
    logits = torch.zeros(38)
    logits[25:32] = torch.tensor([0.01, 0.01, 1.94, 2.04, 3.45, 5.12, 26.95])
    logits[35] = 30.0
    params = SamplingParams(temperature=2e31, top_k=8, repetition_penalty=9.5e-264)
    states = [SamplingState(params, output_ids=[35]) for _ in range(400)]
    out = Sampler(seed=4).sample(logits.expand(400, 38), states)
    assert set(out.token_ids) <= {25, 26, 27, 28, 29, 30, 31, 35}  # the top 8 (two tied at 0.01)
    assert len(set(out.token_ids)) == 8  # a huge temperature: near uniform over them


def test_a_logit_bias_beyond_float32_neither_fails_nor_flips() -> None:
    logits = wide_logits(2, 50, seed=5)
    params = SamplingParams(temperature=1.0, logit_bias=((3, 1e300), (4, -1e300), (5, 3e38)))
    out = Sampler(seed=5).sample_each(logits, [SamplingState(params) for _ in range(2)])
    assert all(isinstance(o, SampledToken) for o in out)  # an inf bias failed the row before
    # both biases stop at float32's largest value: a tie, never a lower token above them
    assert {o.token_id for o in out if isinstance(o, SampledToken)} <= {3, 5}


def test_non_finite_logits_fail_their_row_alone() -> None:
    logits = wide_logits(4, 50, seed=3)
    logits[1, 7] = math.nan
    logits[2] = -math.inf
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)] * 2
    states = [SamplingState(p) for p in params]
    outcomes = Sampler(seed=3).sample_each(logits, states)
    assert [type(o) for o in outcomes] == [SampledToken, SamplingFailure, SamplingFailure,
                                           SampledToken]  # fmt: skip
    failures = [o for o in outcomes[1:3] if isinstance(o, SamplingFailure)]
    assert len(failures) == 2 and all(isinstance(o.error, NonFiniteLogitsError) for o in failures)
    with pytest.raises(NonFiniteLogitsError):
        Sampler().sample(logits, states)
    # the healthy rows got what a batch of only them gives (row 3's seeded draw included)
    healthy = Sampler(seed=3).sample(logits[[0, 3]], [SamplingState(p) for p in params[:2]])
    first, last = outcomes[0], outcomes[3]
    assert isinstance(first, SampledToken) and isinstance(last, SampledToken)
    assert [first.token_id, last.token_id] == healthy.token_ids


TINY_TEMPERATURE = 1e-37
TINY_TOP_P = 1e-3  # below 1 / vocab: only the most likely token can be in the nucleus

logit_values = st.integers(-3000, 3000).map(lambda k: k / 100)  # |x| in {0} U [0.01, 30]


def sampling_params(subnormal: bool) -> st.SearchStrategy[SamplingParams]:
    """Every range SamplingParams accepts (subnormal floats only where the CPU keeps them)."""

    def floats(lo: float, hi: float | None = None, **kw: Any) -> st.SearchStrategy[float]:
        return st.floats(lo, hi, allow_subnormal=subnormal, **kw)

    def positive(hi: float | None = None, **kw: Any) -> st.SearchStrategy[float]:
        if subnormal:
            return floats(0.0, hi, exclude_min=True, **kw)
        # (hypothesis's exclude_min cannot step past 0 while subnormals are flushed)
        return floats(sys.float_info.min, hi, **kw)

    return st.builds(
        SamplingParams,
        temperature=st.one_of(
            st.just(0.0), floats(0.0, TINY_TEMPERATURE), floats(0.0, allow_infinity=True)
        ),
        top_p=st.one_of(positive(TINY_TOP_P), positive(1.0)),
        top_k=st.one_of(st.none(), st.integers(1, 50), st.integers(1, 10**18)),
        min_p=st.one_of(st.just(1.0), floats(0.0, 1.0)),
        repetition_penalty=st.one_of(st.just(1.0), positive(allow_infinity=True)),
        presence_penalty=floats(-2.0, 2.0),
        frequency_penalty=floats(-2.0, 2.0),
        seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        logprobs=st.one_of(st.none(), st.integers(0, 20)),
        # the server's range (it clamps to +-100); beyond float32 see the test above
        logit_bias=st.dictionaries(st.integers(0, 45), floats(-100.0, 100.0), max_size=6),
        min_tokens=st.integers(0, 16),
    )


@st.composite
def batches(draw: st.DrawFn, subnormal: bool) -> tuple[torch.Tensor, list[SamplingState]]:
    vocab = draw(st.integers(2, 40))
    rows = draw(st.integers(1, 4))
    logits = torch.tensor(
        draw(st.lists(st.lists(logit_values, min_size=vocab, max_size=vocab), min_size=rows,
                      max_size=rows))
    )  # fmt: skip
    ids = st.lists(st.integers(0, vocab - 1), max_size=12)
    params = sampling_params(subnormal)
    states = [
        SamplingState(
            draw(params),
            prompt_ids=draw(ids),
            output_ids=draw(ids),
            stop_ids=frozenset(draw(ids)),  # what min_tokens bans
        )
        for _ in range(rows)
    ]
    return logits, states


def subnormals_flushed() -> bool:
    return float(torch.tensor([1e-40]) * 1.0) == 0.0


@pytest.fixture(params=[False, True], ids=["subnormals", "flushed"])
def flush_subnormals(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Run with subnormal numbers kept, then flushed to zero, as they are once the native
    kernels (built with -ffast-math) are loaded; the state before is restored after."""
    before = subnormals_flushed()
    torch.set_flush_denormal(request.param)
    assert subnormals_flushed() == request.param
    yield request.param
    torch.set_flush_denormal(before)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_accepted_parameter_gives_a_valid_token_and_the_greedy_limits(
    flush_subnormals: bool, data: st.DataObject
) -> None:
    batch = data.draw(batches(subnormal=not flush_subnormals))
    logits, states = batch
    vocab = logits.shape[1]
    ours = apply_logit_bias(apply_penalties(logits, states), states)
    outcomes = Sampler(seed=0).sample_each(logits, states)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for row, (state, outcome) in enumerate(zip(states, outcomes)):
        params = state.params
        exact = exact_scores(logits[row], state)  # the tokens min_tokens does not ban
        if not exact:  # min_tokens banned the whole (tiny) vocabulary: this row fails alone
            assert isinstance(outcome, SamplingFailure)
            continue
        assert isinstance(outcome, SampledToken), outcome
        token = outcome.token_id
        assert token in exact
        assert all(math.isfinite(float(ours[row, t])) for t in exact)
        assert_same_order(ours[row], exact)
        # top_k: fewer than k tokens are clearly more likely than the chosen one
        if params.top_k is not None:
            assert sum(clearly_above(e, exact[token]) for e in exact.values()) < params.top_k
        at_the_limit = (
            params.temperature <= TINY_TEMPERATURE
            or params.top_p <= TINY_TOP_P
            or params.top_k == 1
            or params.min_p == 1.0
        )
        if at_the_limit:  # the greedy choice (or one tied with it)
            assert not any(clearly_above(e, exact[token]) for e in exact.values())
        if params.logprobs is not None:
            assert outcome.logprobs is not None
            assert math.isfinite(outcome.logprobs.logprob)
            assert outcome.logprobs.logprob == pytest.approx(float(raw[row, token]), abs=1e-5)
            assert len(outcome.logprobs.top) == min(params.logprobs, vocab)
            assert all(math.isfinite(v) for _, v in outcome.logprobs.top)


# ---- an exact reference --------------------------------------------------------------------
def exact_penalised(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> list[Fraction]:
    """The penalised logits of one row in exact rational arithmetic (no clamping, no rounding)."""
    seen = set(prompt) | set(output)
    p = params.repetition_penalty
    scores = []
    for token, value in enumerate(logits.tolist()):
        x = Fraction(value)
        if token in seen and p != 1.0:
            if math.isinf(p):
                x = Fraction(0) if x > 0 else (x * 10**400 if x < 0 else x)  # x * inf, as a limit
            else:
                x = x / Fraction(p) if x > 0 else x * Fraction(p)
        count = list(output).count(token)
        if count:
            x -= Fraction(params.frequency_penalty) * count + Fraction(params.presence_penalty)
        scores.append(x)
    return scores


def exact_scores(logits: torch.Tensor, state: SamplingState) -> dict[int, Fraction]:
    """Penalties, then logit_bias, exactly; the tokens min_tokens bans are left out."""
    params = state.params
    scores = exact_penalised(logits, params, state.prompt_ids, state.output_ids)
    for token, bias in params.logit_bias:
        if token < len(scores):
            scores[token] += Fraction(bias)
    banned = state.stop_ids if len(state.output_ids) < params.min_tokens else frozenset()
    return {t: x for t, x in enumerate(scores) if t not in banned}


def clearly_above(a: Fraction, b: Fraction) -> bool:
    """a > b by more than float32 rounding of the penalty arithmetic could account for."""
    return a - b > Fraction(1, 10**5) * max(Fraction(1), abs(a), abs(b))


def assert_same_order(ours: torch.Tensor, exact: dict[int, Fraction]) -> None:
    """Wherever the exact scores differ clearly, ours order the two tokens the same way."""
    values = ours.tolist()
    for i, a in exact.items():
        for j, b in exact.items():
            if clearly_above(a, b):
                assert values[i] > values[j], (i, j, values[i], values[j], float(a), float(b))
