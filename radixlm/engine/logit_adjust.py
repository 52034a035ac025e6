"""What changes the logits before sampling: penalties, logit_bias and min_tokens bans.

Both functions return the logits untouched when no row asks for anything, else a changed copy,
and change only the positions a row names (the tokens it has seen, biased or banned): a few
hundred per row, not (R, V). A row's logit_bias and bans are tensors built once per request
(`RowAdjust`), never walked in Python per step. No value SamplingParams accepts makes a finite
logit +inf or NaN (only a min_tokens ban is -inf), and the penalties keep the exact order of
realistic logits (see MIN_REPETITION_PENALTY).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixlm.api_types import SamplingParams
from radixlm.engine.sampling_ops import FLOAT32

if TYPE_CHECKING:  # sampler.py imports this module
    from radixlm.engine.sampler import SamplingState

# A repetition penalty further from 1 than these orders tokens no differently for logits of
# magnitude 1e-4 .. 1e4 (seen positive logits stay above every unseen one, seen negative ones
# between 0 and every unseen negative one), while beyond them x / p and x * p leave float32.
MIN_REPETITION_PENALTY = 1e-30
MAX_REPETITION_PENALTY = 1e30


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


@dataclass(frozen=True)
class RowAdjust:
    """One request's logit_bias and min_tokens bans as tensors, normalised once: ids below the
    vocabulary only, a token listed twice summed into one entry."""

    vocab_size: int
    bias_ids: torch.Tensor  # (B,) long, distinct
    bias_values: torch.Tensor  # (B,) float32
    banned_ids: torch.Tensor  # (S,) long: end-of-sequence and stop ids

    @classmethod
    def of(
        cls, logit_bias: Sequence[tuple[int, float]], stop_ids: Iterable[int], vocab_size: int
    ) -> RowAdjust:
        summed: dict[int, float] = {}
        for token, bias in logit_bias:
            if token < vocab_size:
                summed[token] = summed.get(token, 0.0) + bias
        banned = sorted(t for t in stop_ids if t < vocab_size)
        return cls(
            vocab_size,
            torch.tensor(list(summed), dtype=torch.long),
            torch.tensor(list(summed.values()), dtype=torch.float32),
            torch.tensor(banned, dtype=torch.long),
        )


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Return logits with each row's logit_bias added and, while a row has fewer outputs than
    its min_tokens, its stop ids at -inf (the input itself when no row has either). Each row's
    entries are tensors built once per request (`RowAdjust`): a step adds them with one
    index_put_, whatever their number.

    A complete grammar allows only an end-of-sequence id: min_tokens then bans nothing, or the
    row would have no token left.
    """
    vocab_size = logits.shape[1]
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, s in enumerate(states):
        finished = s.matcher is not None and s.matcher.is_finished
        banning = len(s.output_ids) < s.params.min_tokens and not finished
        if not s.params.logit_bias and not banning:
            continue
        adjust = s.row_adjust(vocab_size)
        if len(adjust.bias_ids):
            cols.append(adjust.bias_ids)
            values.append(adjust.bias_values)
            rows.append(torch.full_like(adjust.bias_ids, i))
        if banning and len(adjust.banned_ids):
            cols.append(adjust.banned_ids)
            values.append(torch.full(adjust.banned_ids.shape, float("-inf")))
            rows.append(torch.full_like(adjust.banned_ids, i))
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    index = (torch.cat(rows).to(device), torch.cat(cols).to(device))
    logits.index_put_(index, torch.cat(values).to(device), accumulate=True)
    # A bias beyond float32 (SamplingParams accepts any finite one) must not make a row's top
    # +inf, which fails the row: it stops at float32's largest. Bans stay -inf.
    logits[index] = logits[index].clamp_(max=FLOAT32.max)
    return logits


def _ids(token_ids: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(token_ids), dtype=torch.long)
