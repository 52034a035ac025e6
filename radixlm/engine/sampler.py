"""The sampler: one batched call per decode step turns each request's logits row into a token.

Pipeline for a batch of R rows (every stage touches only the rows that need it):

    raw logits ─► penalties ─► greedy rows: argmax
                               sampled rows: / temperature ─► top_k ─► softmax ─► top_p ─► min_p
                                             ─► inverse-CDF draw with the row's own uniform

Reproducibility: each sampled row consumes exactly one uniform number per step, drawn from its
request's own `random.Random` (seeded from `SamplingParams.seed`) or, for unseeded requests, from
the sampler's shared stream. A seeded request therefore gets the same tokens whatever else shares
its batch, and on any device (the uniforms are drawn on the host).

The sampler keeps no per-request state of its own and never modifies the logits it is given.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixlm.request import SamplingParams

# How many of a row's most likely tokens top-p examines before it falls back to sorting the row.
_NUCLEUS_PROBE = 128


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
    rng: random.Random | None = field(init=False, repr=False)
    # The prompt never changes, so its token set (for the repetition penalty) is built once.
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        seed = self.params.seed
        if seed is None:
            self.rng = None
        elif self.sample_index == 0:
            self.rng = random.Random(seed)
        else:
            self.rng = random.Random(f"{seed}/{self.sample_index}")

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
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        if not states:
            return SampleOutput([], [])
        logits = logits.float()  # a no-op for float32; half-precision cdfs would be too coarse
        scores = apply_penalties(logits, states)  # (R, V), a copy when any penalty applies
        sampled_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not sampled_rows:
            token_ids = scores.argmax(dim=-1)  # (R,) the greedy fast path
        elif len(sampled_rows) == len(states):
            token_ids = self._sample_rows(scores, states)
        else:
            token_ids = scores.argmax(dim=-1)  # the sampled rows overwrite their choice
            index = torch.tensor(sampled_rows, device=logits.device)
            token_ids[index] = self._sample_rows(scores[index], [states[i] for i in sampled_rows])
        chosen = token_ids.tolist()
        return SampleOutput(chosen, _logprobs(logits, states, chosen))

    def _sample_rows(self, scores: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Draw one token per row of `scores` (S, V), all with temperature > 0.

        Every pass over (S, V) costs milliseconds on a CPU (64 x 49152 floats are 12.6 MB), so
        the filters work in place on tensors this function owns and skip rows that are off.
        """
        device = scores.device
        scores = scores / _column([s.params.temperature for s in states], device)  # a new tensor
        _keep_top_k(scores, [s.params.top_k for s in states])
        probs = torch.softmax(scores, dim=-1)  # (S, V); excluded tokens are exactly 0
        _keep_top_p(probs, [s.params.top_p for s in states])
        _keep_min_p(probs, [s.params.min_p for s in states])
        uniforms = [(s.rng or self._rng).random() for s in states]
        return _inverse_cdf(probs, torch.tensor(uniforms, device=device))


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Return logits with each row's penalties applied (the input itself when there are none).

    repetition (HF/CTRL): a logit of a token seen in prompt or output is divided by the penalty
    when positive, multiplied by it when negative. presence/frequency (OpenAI):
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
    vocab_size, device = logits.shape[1], logits.device
    if rep_rows:
        seqs = [
            torch.cat([states[i].prompt_tensor(), _ids(states[i].output_ids)]) for i in rep_rows
        ]
        seen = (_occurrences(seqs, vocab_size) > 0).to(device)  # (P, V)
        penalty = _column([states[i].params.repetition_penalty for i in rep_rows], device)
        rows = torch.tensor(rep_rows, device=device)
        x = logits[rows]
        logits[rows] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if freq_rows:
        counts = _occurrences([_ids(states[i].output_ids) for i in freq_rows], vocab_size)
        counts = counts.to(device)  # (F, V)
        frequency = _column([states[i].params.frequency_penalty for i in freq_rows], device)
        presence = _column([states[i].params.presence_penalty for i in freq_rows], device)
        rows = torch.tensor(freq_rows, device=device)
        logits[rows] -= frequency * counts + presence * (counts > 0)
    return logits


def _occurrences(seqs: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """(len(seqs), vocab_size) float32 counts of each token id in each sequence, on the host."""
    rows = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(seqs)])
    counts = torch.zeros(len(seqs), vocab_size)
    counts.index_put_((rows, torch.cat(list(seqs))), torch.ones(len(rows)), accumulate=True)
    return counts


def _keep_top_k(scores: torch.Tensor, top_k: Sequence[int | None]) -> None:
    """In place: -inf all but each row's k highest scores (ties with the k-th stay)."""
    rows = [i for i, k in enumerate(top_k) if k is not None and k < scores.shape[1]]
    if not rows:
        return
    ks = torch.tensor([top_k[i] for i in rows], device=scores.device)
    sub, index = _take_rows(scores, rows)  # (K, V)
    ranked = torch.topk(sub, int(ks.max()), dim=-1).values  # (K, max_k), descending
    kth = ranked.gather(1, (ks - 1)[:, None])  # (K, 1)
    sub.masked_fill_(sub < kth, float("-inf"))
    _put_rows(scores, index, sub)


def _keep_top_p(probs: torch.Tensor, top_p: Sequence[float]) -> None:
    """In place: zero every token outside its row's nucleus.

    A token is in the nucleus when the mass of the tokens strictly more likely than it is below
    top_p, so tied tokens are kept or dropped together. A full sort of V probabilities costs
    ~3 ms per row on a CPU core, so the nucleus is first looked for among each row's
    `_NUCLEUS_PROBE` most likely tokens (one batched topk), which hold it whenever their mass
    reaches top_p; only the other rows are sorted, and then only their candidates.
    """
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    sub, index = _take_rows(probs, rows)  # (P, V)
    p_col = _column([top_p[i] for i in rows], probs.device)  # (P, 1)
    ranked = torch.topk(sub, min(_NUCLEUS_PROBE, sub.shape[1]), dim=-1).values  # (P, k)
    mass_above = ranked.cumsum(dim=-1) - ranked
    last = (mass_above < p_col).sum(dim=-1, keepdim=True) - 1  # >= 0: the top has none above
    threshold = ranked.gather(1, last)  # (P, 1) the least likely token of the nucleus
    beyond_probe = (ranked.sum(dim=-1) < p_col[:, 0]).nonzero().flatten().tolist()
    for j in beyond_probe:
        threshold[j, 0] = _nucleus_threshold(sub[j], top_p[rows[j]])
    sub.masked_fill_(sub < threshold, 0.0)
    _put_rows(probs, index, sub)


def _keep_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> None:
    """In place: zero the tokens less likely than min_p times their row's most likely token."""
    if all(p == 0.0 for p in min_p):
        return
    max_prob = probs.max(dim=-1, keepdim=True).values  # (S, 1)
    probs.masked_fill_(probs < _column(min_p, probs.device) * max_prob, 0.0)


def _take_rows(x: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x itself, None) when `rows` are all of x's rows, else (a copy of those rows, index)."""
    if len(rows) == x.shape[0]:
        return x, None
    index = torch.tensor(rows, device=x.device)
    return x[index], index


def _put_rows(x: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Write back what `_take_rows` copied out (nothing to do when it handed out x itself)."""
    if index is not None:
        x[index] = rows


def _nucleus_threshold(row: torch.Tensor, top_p: float) -> float:
    """The probability of the least likely token in the nucleus of one row (V,).

    Only candidates are sorted: a token with p <= (1 - top_p) / V has at least 1 - V * p >=
    top_p of mass above it, so it is never in the nucleus.
    """
    candidates = row[row > 0.5 * (1.0 - top_p) / row.shape[0]]  # halved: slack for rounding
    ranked = candidates.sort(descending=True).values
    mass_above = ranked.cumsum(dim=0) - ranked
    return float(ranked[int((mass_above < top_p).sum()) - 1])


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """(len(values), 1) float32 on `device`, to broadcast one value per row."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _ids(token_ids: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(token_ids), dtype=torch.long)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token i of each row such that cdf[i-1] <= u * total < cdf[i], for u in [0, 1).

    A zero-probability token has cdf[i] == cdf[i-1], so it can never be chosen; the rows need
    not be normalised.
    """
    cdf = probs.cumsum(dim=-1)  # (S, V)
    targets = uniforms.to(cdf.dtype) * cdf[:, -1]
    chosen = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    overflow = chosen == cdf.shape[1]
    if bool(overflow.any()):
        # u * total rounded up to total: take the last token with mass (the cdf's first maximum
        # is where it last grew).
        chosen = torch.where(overflow, cdf.argmax(dim=-1), chosen)
    return chosen


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
    num_top = max(states[i].params.logprobs or 0 for i in rows)
    top = torch.topk(logprobs, num_top, dim=-1)  # (L, num_top)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs or 0
        alternatives = list(zip(top_ids[j][:n], top_values[j][:n]))
        result[i] = TokenLogprobs(chosen_logprobs[j], alternatives)
    return result
