"""The sampler: greedy is argmax, filters never pick an excluded token, seeds reproduce, penalties
and logprobs are exactly as defined."""

from __future__ import annotations

import pytest
import torch

from radixlm.api_types import SamplingParams
from radixlm.engine.sampler import Sampler, SamplingState, apply_penalties

VOCAB = 50


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def states(params: SamplingParams, rows: int) -> list[SamplingState]:
    return [SamplingState(params) for _ in range(rows)]


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = random_logits(16, seed=0)
    before = logits.clone()
    out = Sampler(seed=0).sample(logits, states(SamplingParams(temperature=0), 16))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(32, seed=1)
    out = Sampler(seed=1).sample(logits, states(SamplingParams(temperature=1.5, top_k=1), 32))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_beside_sampled_rows() -> None:
    logits = random_logits(6, seed=2)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_p=0.9) for i in range(6)]
    out = Sampler(seed=2).sample(logits, [SamplingState(p) for p in params])
    for i in (1, 3, 5):
        assert out.token_ids[i] == int(logits[i].argmax())


def run_seeded(neighbours: list[SamplingParams], position: int, steps: int = 25) -> list[int]:
    """Tokens of a seed-7 request sampled `steps` times inside a batch of `neighbours`."""
    target = SamplingState(SamplingParams(temperature=1.0, top_p=0.95, seed=7))
    batch = [SamplingState(p) for p in neighbours]
    batch.insert(position, target)
    sampler = Sampler(seed=len(neighbours))  # the unseeded neighbours draw differently each run
    tokens = []
    for step in range(steps):
        logits = random_logits(len(batch), seed=100 + step)
        logits[position] = random_logits(1, seed=step)[0]  # the target's row depends on step only
        tokens.append(sampler.sample(logits, batch).token_ids[position])
    return tokens


def test_seeded_request_reproduces_whatever_its_batch() -> None:
    alone = run_seeded([], position=0)
    assert run_seeded([], position=0) == alone
    crowd = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
        SamplingParams(temperature=0.9, min_p=0.1, frequency_penalty=1.0),
    ]
    assert run_seeded(crowd, position=2) == alone
    assert run_seeded(crowd[:1], position=1) == alone
    assert len(set(alone)) > 5  # it really samples


def test_sample_index_gives_forks_their_own_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    logits = random_logits(1, seed=3, vocab=1000)
    draws = {}
    for index in (0, 1):
        state, sampler = SamplingState(params, sample_index=index), Sampler()
        draws[index] = [sampler.sample(logits, [state]).token_ids[0] for _ in range(10)]
    plain, sampler = SamplingState(params), Sampler()
    assert [sampler.sample(logits, [plain]).token_ids[0] for _ in range(10)] == draws[0]
    assert draws[0] != draws[1]


def reference_allowed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Renormalised probabilities after top_k -> top_p -> min_p, by brute force over a sort."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if params.top_k is not None and rank >= params.top_k:
            break
        keep[token] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    nucleus = torch.zeros_like(keep)
    for token in probs.argsort(descending=True).tolist():
        if mass >= params.top_p:
            break
        nucleus[token] = keep[token]
        mass += float(probs[token])
    probs = torch.where(nucleus, probs, 0.0)
    probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=12, top_p=0.8, min_p=0.05),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "all"],
)
def test_filters_never_pick_an_excluded_token_and_keep_proportions(
    params: SamplingParams,
) -> None:
    logits = random_logits(1, seed=4)[0]
    expected = reference_allowed(logits, params)
    draws = 6000
    out = Sampler(seed=5).sample(logits.expand(draws, VOCAB), states(params, draws))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double() / draws
    assert set(out.token_ids) <= set(expected.nonzero().flatten().tolist())
    assert float((counts - expected).abs().max()) < 0.025


def test_top_p_falls_back_beyond_the_probe() -> None:
    """A flat row needs more than the probed 128 tokens to reach top_p; the result is the same."""
    logits = torch.linspace(0.0, 0.1, 1000)[None, :]  # almost flat, no ties
    logits[0, :10] = 1.0  # ten likelier tokens
    params = SamplingParams(temperature=1.0, top_p=0.5)
    expected = reference_allowed(logits[0], params).nonzero().flatten().tolist()
    out = Sampler(seed=6).sample(logits.expand(3000, 1000), states(params, 3000))
    assert set(out.token_ids) <= set(expected)
    assert len(set(out.token_ids)) > 300  # the nucleus really is wide


def test_top_p_keeps_or_drops_tied_tokens_together() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_p=0.6)  # the top token alone holds 0.69
    out = Sampler(seed=9).sample(logits.expand(500, 5), states(params, 500))
    assert set(out.token_ids) == {0}
    params = SamplingParams(temperature=1.0, top_p=0.75)  # needs one of the three tied tokens
    out = Sampler(seed=9).sample(logits.expand(2000, 5), states(params, 2000))
    assert set(out.token_ids) == {0, 1, 2, 3}


def test_penalties_match_a_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = SamplingState(params, prompt_ids=[0, 1], output_ids=[1, 3, 3])
    plain = SamplingState(SamplingParams(), prompt_ids=[0, 1], output_ids=[1, 3, 3])
    out = apply_penalties(logits, [penalised, plain])
    # repetition over prompt + output {0, 1, 3}: 2 / 2, -1 * 2, 3 / 2;
    # then output counts {1: 1, 3: 2}: token 1 -= 0.25 + 0.5, token 3 -= 0.5 + 0.5.
    assert out[0].tolist() == [1.0, -2.75, 0.5, 0.5, -2.0, 0.0]
    assert torch.equal(out[1], logits[1])
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]  # the input is not modified


def test_presence_and_frequency_ignore_the_prompt() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    no_output = SamplingState(params, prompt_ids=[0, 1, 2, 3])
    assert torch.equal(apply_penalties(logits, [no_output]), logits)
    with_output = SamplingState(params, prompt_ids=[0, 1, 2, 3], output_ids=[2, 2])
    assert apply_penalties(logits, [with_output])[0].tolist() == [0.0, 0.0, -3.0, 0.0]


def test_penalised_greedy_avoids_the_repeated_token() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    state = SamplingState(params, prompt_ids=[0])
    assert Sampler().sample(logits, [state]).token_ids == [1]


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(3, seed=7)
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.3, logprobs=4),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    batch = [SamplingState(p, prompt_ids=[1, 2]) for p in params]
    out = Sampler(seed=8).sample(logits, batch)
    reference = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert first is not None and second is not None and third is None
    assert (first.token_id, second.token_id) == (out.token_ids[0], out.token_ids[1])
    assert first.logprob == pytest.approx(float(reference[0, out.token_ids[0]]), abs=1e-6)
    top = torch.topk(reference[0], 4)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert second.top == ()
    assert second.logprob == pytest.approx(float(reference[1].max()), abs=1e-6)


def test_empty_batch_and_mismatched_shapes() -> None:
    assert Sampler().sample(torch.zeros(0, VOCAB), []) == ([], [])
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.zeros(2, VOCAB), states(SamplingParams(), 3))
