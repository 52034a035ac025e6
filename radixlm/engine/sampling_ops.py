"""The sampler's filters: temperature, top-k, top-p, min-p and the inverse-CDF draw.

Each is safe for every value `SamplingParams` accepts, including values that do not survive a
float32 conversion (a top_p or a temperature of 1e-300 is 0.0 in float32, 1e300 is inf), and
with subnormal numbers flushed to zero (the native kernels' -ffast-math sets that process-wide):

- the filters decide on the scores themselves, before any shift or temperature, and by score
  rather than by float32 probability: top-k and top-p rank by score, min-p compares with
  row max + temperature * log(min_p). Scores still tell tokens apart where a tiny or a huge
  temperature has rounded their probabilities together (or a huge row max has absorbed the
  others in `scores - max`), so the limits are exact (a tiny temperature, a tiny top_p, min_p 1:
  the greedy choice), and each filter keeps its row's top token whatever rounding did to its
  threshold: a row never ends up empty;
- probabilities are exp((scores - row max) / temperature): the top token weighs 1, and the
  division can only overflow towards -inf (weight 0), never to +inf or NaN; a temperature is
  clamped into float32's normal range before it divides.

Filters work in place (excluded tokens become -inf) and skip the rows that are off: every pass
over (S, V) costs milliseconds on a CPU (64 x 49152 floats are 12.6 MB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# How many of a row's most likely tokens top-p examines before it falls back to sorting the row.
NUCLEUS_PROBE = 128

FLOAT32 = torch.finfo(torch.float32)


def keep_top_k(scores: torch.Tensor, top_k: Sequence[int | None]) -> None:
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


def keep_top_p(
    scores: torch.Tensor,
    row_max: torch.Tensor,
    top_p: Sequence[float],
    temperature: Sequence[float],
) -> None:
    """In place: -inf every token of `scores` (S, V) outside its row's nucleus.

    A token is in the nucleus when the mass of the tokens with a higher score is below top_p, so
    tied tokens are kept or dropped together, and the top token always is (a top_p that rounds
    to 0 in float32 keeps it alone). A full sort of V tokens costs ~3 ms per row on a CPU core,
    so the nucleus is first looked for among each row's `NUCLEUS_PROBE` best tokens (one batched
    topk), which hold it whenever their mass reaches top_p; only the other rows are sorted, and
    then only their candidates.
    """
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    sub, index = _take_rows(scores, rows)  # (P, V)
    sub_max = row_max if index is None else row_max[index]
    scaled = (sub - sub_max[:, None]).div_(_temperature_column([temperature[i] for i in rows], sub))
    probs = torch.softmax(scaled, dim=-1)  # (P, V)
    p_col = column([top_p[i] for i in rows], scores.device)  # (P, 1)
    ranked = torch.topk(sub, min(NUCLEUS_PROBE, sub.shape[1]), dim=-1)  # (P, k) best first
    ranked_probs = probs.gather(1, ranked.indices)
    mass_above = ranked_probs.cumsum(dim=-1) - ranked_probs
    in_nucleus = (mass_above < p_col).sum(dim=-1, keepdim=True)  # (P, 1)
    threshold = ranked.values.gather(1, (in_nucleus - 1).clamp_(min=0))  # the last one kept
    beyond_probe = (ranked_probs.sum(dim=-1) < p_col[:, 0]).nonzero().flatten().tolist()
    for j in beyond_probe:
        threshold[j, 0] = _nucleus_threshold(sub[j], probs[j], top_p[rows[j]])
    sub.masked_fill_(sub < threshold, float("-inf"))
    _put_rows(scores, index, sub)


def keep_min_p(
    scores: torch.Tensor,
    row_max: torch.Tensor,
    min_p: Sequence[float],
    temperature: Sequence[float],
) -> None:
    """In place: -inf the tokens less likely than min_p times their row's top token.

    p / p_top = exp((score - max) / temperature) >= min_p  <=>
    score >= max + temperature * log(min_p), the last term computed in float64; stays exact
    where the probabilities would round (min_p 1 keeps the top token and its ties only, at any
    temperature).
    """
    if all(p == 0.0 for p in min_p):
        return
    margins = [_min_p_margin(p, t) for p, t in zip(min_p, temperature, strict=True)]
    threshold = row_max[:, None] + column(margins, scores.device)  # (S, 1)
    scores.masked_fill_(scores < threshold, float("-inf"))


def weights(
    scores: torch.Tensor, row_max: torch.Tensor, temperature: Sequence[float]
) -> torch.Tensor:
    """In place: exp((scores - row_max) / temperature), the unnormalised distribution (the top
    token weighs 1, -inf tokens 0). A temperature below float32's smallest normal number acts as
    that number (every token not tied with the top weighs 0: the greedy limit); one above
    float32's largest as that (every finite token weighs the same)."""
    shifted = scores.sub_(row_max[:, None])  # (S, V) <= 0
    return shifted.div_(_temperature_column(temperature, scores)).exp_()


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token i of each row such that cdf[i-1] <= u * total < cdf[i], for u in [0, 1).

    A zero-probability token has cdf[i] == cdf[i-1], so it can never be chosen; the rows need
    not be normalised, only hold some mass.
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


def column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """(len(values), 1) float32 on `device`, to broadcast one value per row."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _min_p_margin(min_p: float, temperature: float) -> float:
    if min_p == 0.0:
        return -math.inf
    if min_p >= 1.0:
        return 0.0  # not temperature * 0, which is NaN for an infinite temperature
    return temperature * math.log(min_p)


def _temperature_column(temperature: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return column([min(max(t, FLOAT32.tiny), FLOAT32.max) for t in temperature], like.device)


def _nucleus_threshold(scores: torch.Tensor, probs: torch.Tensor, top_p: float) -> float:
    """The score of the last token in the nucleus of one row (scores and probs: (V,)).

    Only candidates are sorted: a token with p <= (1 - top_p) / V has at least 1 - V * p >=
    top_p of mass above it, so it is never in the nucleus.
    """
    candidates = probs > 0.5 * (1.0 - top_p) / probs.shape[0]  # halved: slack for rounding
    ranked_scores, order = scores[candidates].sort(descending=True)
    ranked_probs = probs[candidates][order]
    mass_above = ranked_probs.cumsum(dim=0) - ranked_probs
    return float(ranked_scores[max(int((mass_above < top_p).sum()) - 1, 0)])


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
