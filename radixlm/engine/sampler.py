"""The sampler: one batched call per decode step turns each request's logits row into a token.

Pipeline for a batch of R rows (every stage touches only the rows that need it):

    raw logits ─► penalties, logit_bias, min_tokens bans ─► grammar masks ─► scores
    scores ─► greedy rows: argmax
              sampled rows: top_k ─► top_p ─► min_p (on the scores)
                            ─► exp((scores - row max) / temperature)
                            ─► inverse-CDF draw with the row's own uniform

Reproducibility: each sampled row consumes exactly one uniform number per step, drawn from its
request's own `random.Random` (seeded from `SamplingParams.seed`) or, for unseeded requests, from
the sampler's shared stream. A seeded request therefore gets the same tokens whatever else shares
its batch, and on any device (the uniforms are drawn on the host).

Failure isolation: `sample_each` gives every row its own outcome, a token or the error that
row raised, so one request's bad state or bad logits never cost the other rows their token.

Numerical safety for every accepted parameter value is the business of `logit_adjust` (clamped
penalties and biases) and `sampling_ops` (the filters); rows whose scores have no finite
maximum (NaN or inf from the model, or every token banned) raise `NonFiniteLogitsError`.

The sampler keeps no per-request state of its own and never modifies the logits it is given.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixlm.agents.grammar import GrammarError, GrammarMatcher, apply_token_masks
from radixlm.api_types import SamplingParams, TokenLogprob
from radixlm.engine.logit_adjust import RowAdjust, apply_logit_bias, apply_penalties
from radixlm.engine.sampling_ops import (
    inverse_cdf,
    keep_min_p,
    keep_top_k,
    keep_top_p,
    weights,
)


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
    # logit_bias and the min_tokens bans as tensors, built once (logit_adjust.RowAdjust)
    _adjust: RowAdjust | None = field(default=None, init=False, repr=False)

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

    def row_adjust(self, vocab_size: int) -> RowAdjust:
        """This request's logit_bias (duplicates summed) and bans, normalised into tensors on
        first use: a step then costs tensor ops, never a Python loop over the entries."""
        if self._adjust is None or self._adjust.vocab_size != vocab_size:
            self._adjust = RowAdjust.of(self.params.logit_bias, self.stop_ids, vocab_size)
        return self._adjust


class SampleOutput(NamedTuple):
    token_ids: list[int]  # one per row, in the order of the states
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


class SampledToken(NamedTuple):
    """One row's outcome of `Sampler.sample_each`: its token."""

    token_id: int
    logprobs: TokenLogprob | None  # None where the request asked for none


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


def _check_shape(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")


def _logprobs(
    logits: torch.Tensor, states: Sequence[SamplingState], chosen: Sequence[int]
) -> list[TokenLogprob | None]:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(states)
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
        alternatives = tuple(zip(top_ids[j][:n], top_values[j][:n]))
        result[i] = TokenLogprob(chosen[i], chosen_logprobs[j], alternatives)
    return result
