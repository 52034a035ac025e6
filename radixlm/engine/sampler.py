"""The sampler: one batched call per decode step turns each request's logits row into a token.

Pipeline for a batch of R rows (every stage touches only the rows that need it):

    raw logits ─► penalties ─► greedy rows: argmax
                               sampled rows: top_k ─► top_p ─► min_p (on the scores)
                                             ─► exp((scores - row max) / temperature)
                                             ─► inverse-CDF draw with the row's own uniform

Reproducibility: each sampled row consumes exactly one uniform number per step, drawn from its
request's own `random.Random` (seeded from `SamplingParams.seed`) or, for unseeded requests, from
the sampler's shared stream. A seeded request therefore gets the same tokens whatever else shares
its batch, and on any device (the uniforms are drawn on the host).

Failure isolation: `sample_each` gives every row its own outcome, a token or the error that
row raised, so one request's bad state or bad logits never cost the other rows their token.

Numerical safety for every accepted parameter value is the business of `sampling_ops` (the
filters) and `apply_penalties` (clamped penalties); rows whose logits have no finite maximum
(NaN or inf from the model) raise `NonFiniteLogitsError`.

The sampler keeps no per-request state of its own and never modifies the logits it is given.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixlm.agents.grammar import GrammarError, GrammarMatcher, apply_token_masks
from radixlm.engine.sampling_ops import (
    FLOAT32,
    inverse_cdf,
    keep_min_p,
    keep_top_k,
    keep_top_p,
    weights,
)
from radixlm.request import SamplingParams

# A repetition penalty further from 1 than these orders tokens no differently for logits of
# magnitude 1e-4 .. 1e4 (seen positive logits stay above every unseen one, seen negative ones
# between 0 and every unseen negative one), while beyond them x / p and x * p leave float32.
MIN_REPETITION_PENALTY = 1e-30
MAX_REPETITION_PENALTY = 1e30


@dataclass
class SamplingState:
    """What the sampler needs to know about one request (or one of its n samples).

    `prompt_ids` and `output_ids` may alias the engine's own lists: the sampler only reads them,
    at the moment `Sampler.sample` is called. `rng` is seeded from `params.seed`; the forks of an
    n > 1 request pass distinct `sample_index` values so their streams differ (index 0 draws the
    same stream as a plain request with that seed).
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    sample_index: int = 0
    stop_ids: frozenset[int] = frozenset()  # what min_tokens bans: end-of-sequence and stop ids
    rng: random.Random | None = field(init=False, repr=False)
    # This sample's own position in the request's grammar (None: unconstrained).
    matcher: GrammarMatcher | None = field(init=False, repr=False)
    # The prompt never changes, so its token set (for the repetition penalty) is built once.
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        constraint = self.params.constraint
        self.matcher = constraint.new_matcher() if constraint is not None else None
        seed = self.params.seed
        if seed is None:
            self.rng = None
        elif self.sample_index == 0:
            self.rng = random.Random(seed)
        else:
            self.rng = random.Random(f"{seed}/{self.sample_index}")

    def advance(self, token_id: int) -> None:
        """Move the grammar past the sampled token; GrammarError when it rejects it."""
        if self.matcher is not None:
            self.matcher.advance(token_id)

    def prompt_tensor(self) -> torch.Tensor:
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.as_tensor(list(self.prompt_ids), dtype=torch.long)
        return self._prompt_tensor


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one sampled position under the model's raw distribution."""

    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # the `logprobs` most likely (token id, logprob), best first


class SampleOutput(NamedTuple):
    token_ids: list[int]  # one per row, in the order of the states
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class SampledToken(NamedTuple):
    """One row's outcome of `Sampler.sample_each`: its token."""

    token_id: int
    logprobs: TokenLogprobs | None  # None where the request asked for none


class SamplingFailure(NamedTuple):
    """One row's outcome of `Sampler.sample_each`: what sampling it raised."""

    error: Exception


class NonFiniteLogitsError(ValueError):
    """A row's logits have no finite maximum (NaN, +inf, or every token -inf)."""


class Sampler:
    """Chooses the next token for every row of a batch; see the module docstring."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)  # the uniforms of unseeded requests

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
        """Pick one token per row of `logits` (R, V), row i under `states[i]`.

        Reads the states' params and token ids; advances the random stream of every sampled row
        (its own `rng`, or the sampler's for unseeded rows), by exactly one draw per step.
        Logprobs are those of the raw logits (log_softmax before penalties, temperature and
        truncation): the model's own distribution, comparable across sampling settings.
        Raises what any row raises (see `sample_each` for per-row outcomes).
        """
        _check_shape(logits, states)
        if not states:
            return SampleOutput([], [])
        return self._sample(logits, states, [self._draw(s) for s in states])

    def sample_each(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> list[SampledToken | SamplingFailure]:
        """`sample`, with one outcome per row: a row that raises fails alone.

        The batch is sampled in one call; only if that call raises is it repeated row by row
        to find the rows at fault. Each row's uniform is drawn once, before either attempt, so
        the rows that succeed get exactly the tokens one batched call would have given them.
        """
        _check_shape(logits, states)
        uniforms: dict[int, float] = {}
        failed: dict[int, SamplingFailure] = {}
        for i, state in enumerate(states):
            try:
                uniforms[i] = self._draw(state)
            except Exception as exc:
                failed[i] = SamplingFailure(exc)
        rows = list(uniforms)
        sampled: dict[int, SampledToken] = {}
        try:
            batch = logits if len(rows) == len(states) else logits[rows]
            out = self._sample(batch, [states[i] for i in rows], list(uniforms.values()))
            for i, token, logprobs in zip(rows, out.token_ids, out.logprobs, strict=True):
                sampled[i] = SampledToken(token, logprobs)
        except Exception:
            for i in rows:  # find the rows at fault
                try:
                    out = self._sample(logits[i : i + 1], [states[i]], [uniforms[i]])
                    sampled[i] = SampledToken(out.token_ids[0], out.logprobs[0])
                except Exception as exc:
                    failed[i] = SamplingFailure(exc)
        return [sampled[i] if i in sampled else failed[i] for i in range(len(states))]

    def _draw(self, state: SamplingState) -> float:
        """The row's uniform for this step (greedy rows draw none: theirs is never read)."""
        if state.params.greedy:
            return 0.0
        return (state.rng or self._rng).random()

    def _sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], uniforms: Sequence[float]
    ) -> SampleOutput:
        logits = logits.float()  # a no-op for float32; half-precision cdfs would be too coarse
        scores = apply_penalties(logits, states)  # (R, V), a copy when any penalty applies
        scores = apply_logit_bias(scores, states)  # a copy when any bias or ban applies
        if any(s.matcher is not None for s in states):
            masked = apply_token_masks(scores, [s.matcher for s in states])  # one batched op
            if masked.failed:  # sample_each retries row by row: only these rows fail
                raise GrammarError(f"rows {masked.failed}: the grammar allows no token")
            scores = masked.scores
        best = scores.max(dim=-1)  # (R,) values and indices: the greedy choice, first of ties
        finite = torch.isfinite(best.values)
        if not bool(finite.all()):
            rows = (~finite).nonzero().flatten().tolist()
            raise NonFiniteLogitsError(f"rows {rows} have no finite maximum logit")
        token_ids = best.indices
        sampled_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if len(sampled_rows) == len(states):
            # the filters write into their scores: a copy unless the penalties made one
            own = scores.clone() if scores is logits else scores
            token_ids = self._sample_rows(own, best.values, states, uniforms)
        elif sampled_rows:  # the sampled rows overwrite their greedy choice
            index = torch.tensor(sampled_rows, device=logits.device)
            token_ids[index] = self._sample_rows(
                scores[index],
                best.values[index],
                [states[i] for i in sampled_rows],
                [uniforms[i] for i in sampled_rows],
            )
        chosen = token_ids.tolist()
        return SampleOutput(chosen, _logprobs(logits, states, chosen))

    def _sample_rows(
        self,
        scores: torch.Tensor,
        row_max: torch.Tensor,
        states: Sequence[SamplingState],
        uniforms: Sequence[float],
    ) -> torch.Tensor:
        """Draw one token per row of `scores` (S, V), all with temperature > 0; the filters
        write into `scores`."""
        temperature = [s.params.temperature for s in states]
        keep_top_k(scores, [s.params.top_k for s in states])
        keep_top_p(scores, row_max, [s.params.top_p for s in states], temperature)
        keep_min_p(scores, row_max, [s.params.min_p for s in states], temperature)
        probs = weights(scores, row_max, temperature)  # (S, V) unnormalised, excluded tokens 0
        return inverse_cdf(probs, torch.tensor(list(uniforms), device=scores.device))


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Return logits with each row's penalties applied (the input itself when there are none).

    repetition (HF/CTRL): a logit of a token seen in prompt or output is divided by the penalty
    when positive, multiplied by it when negative; the penalty is clamped to
    [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY] and the result to float32's range, so
    finite logits stay finite and keep their order. presence/frequency (OpenAI):
    logit -= frequency * count + presence * (count > 0), counting the output only.
    """
    rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    freq_rows = [
        i
        for i, s in enumerate(states)
        if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_ids
    ]
    if not rep_rows and not freq_rows:
        return logits
    logits = logits.clone()
    flat = logits.view(-1)  # (R * V,): token t of row r at r * V + t
    num_rows, vocab_size, device = logits.shape[0], logits.shape[1], logits.device
    # Only the tokens a row has seen change: update those (a few hundred per row), not (R, V).
    if rep_rows:
        seqs = [
            torch.cat([states[i].prompt_tensor(), _ids(states[i].output_ids)]) for i in rep_rows
        ]
        seen = _positions(seqs, rep_rows, vocab_size)
        penalties = [_clamped_penalty(states[i].params) for i in rep_rows]
        penalty = _by_row(rep_rows, penalties, num_rows)[seen.row].to(device)
        index = seen.flat_index.to(device)
        x = flat[index]
        x = torch.where(x > 0, x / penalty, x * penalty)
        flat[index] = x.clamp_(FLOAT32.min, FLOAT32.max)
    if freq_rows:
        out = _positions([_ids(states[i].output_ids) for i in freq_rows], freq_rows, vocab_size)
        params = [states[i].params for i in freq_rows]
        frequency = _by_row(freq_rows, [p.frequency_penalty for p in params], num_rows)[out.row]
        presence = _by_row(freq_rows, [p.presence_penalty for p in params], num_rows)[out.row]
        shift = frequency * out.occurrences + presence
        flat[out.flat_index.to(device)] -= shift.to(device)
    return logits


class _Positions(NamedTuple):
    """The distinct tokens of some rows' sequences, as positions in the flattened (R, V)."""

    flat_index: torch.Tensor  # (N,) row * V + token, ascending
    row: torch.Tensor  # (N,) the row of each
    occurrences: torch.Tensor  # (N,) float32: how often the token is in its row's sequence


def _positions(seqs: Sequence[torch.Tensor], rows: Sequence[int], vocab_size: int) -> _Positions:
    flat = torch.cat([seq + row * vocab_size for seq, row in zip(seqs, rows, strict=True)])
    index, count = torch.unique(flat, return_counts=True)
    return _Positions(index, index // vocab_size, count.float())


def _by_row(rows: Sequence[int], values: Sequence[float], num_rows: int) -> torch.Tensor:
    """(num_rows,) float32 on the host: values[i] at rows[i], 0 elsewhere."""
    result = torch.zeros(num_rows)
    result[torch.tensor(rows, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    return result


def _clamped_penalty(params: SamplingParams) -> float:
    return min(max(params.repetition_penalty, MIN_REPETITION_PENALTY), MAX_REPETITION_PENALTY)


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Return logits with each row's logit_bias added and, while a row has fewer outputs than
    its min_tokens, its stop ids at -inf (the input itself when no row has either).

    A complete grammar allows only an end-of-sequence id: min_tokens then bans nothing, or the
    row would have no token left.
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab_size = logits.shape[1]
    for i, s in enumerate(states):
        for token, bias in s.params.logit_bias:
            if token < vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        finished = s.matcher is not None and s.matcher.is_finished
        if len(s.output_ids) < s.params.min_tokens and not finished:
            banned = [t for t in s.stop_ids if t < vocab_size]
            rows += [i] * len(banned)
            cols += banned
            values += [float("-inf")] * len(banned)
    if not rows:
        return logits
    logits = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)
    # A bias beyond float32 (SamplingParams accepts any finite one) must not make a row's top
    # +inf, which fails the row: it stops at float32's largest. Bans stay -inf.
    logits[index] = logits[index].clamp_(max=FLOAT32.max)
    return logits


def _check_shape(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")


def _ids(token_ids: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(token_ids), dtype=torch.long)


def _logprobs(
    logits: torch.Tensor, states: Sequence[SamplingState], chosen: Sequence[int]
) -> list[TokenLogprobs | None]:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(states)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
    chosen_ids = torch.tensor([[chosen[i]] for i in rows], device=logits.device)
    chosen_logprobs = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    num_top = min(max(states[i].params.logprobs or 0 for i in rows), logits.shape[1])
    top = torch.topk(logprobs, num_top, dim=-1)  # (L, num_top)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs or 0
        alternatives = list(zip(top_ids[j][:n], top_values[j][:n]))
        result[i] = TokenLogprobs(chosen_logprobs[j], alternatives)
    return result
