"""The sampler's filters: temperature, top-k, top-p, min-p and the inverse-CDF draw.

Each is safe for every value `SamplingParams` accepts, including values that do not survive a
float32 conversion (a top_p or a temperature of 1e-300 is 0.0 in float32, 1e300 is inf):

- temperature scales `scores - row max`, never the raw scores: the top token sits at 0, so the
  scaled row can only overflow towards -inf (weight 0), never to +inf or NaN, and a tiny
  temperature tends to the greedy choice; the temperature itself is clamped into float32's
  normal range first;
- the filters compare scores, not float32 probabilities, wherever they can (min_p as a log
  threshold, top_p ranking by score), so tokens the probabilities can no longer tell apart are
  still told apart, and each filter keeps its row's most likely token whatever rounding did to
  its threshold: a row never ends up empty.

Filters work in place on the scaled scores (excluded tokens become -inf) and skip the rows that
are off: every pass over (S, V) costs milliseconds on a CPU (64 x 49152 floats are 12.6 MB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# How many of a row's most likely tokens top-p examines before it falls back to sorting the row.
NUCLEUS_PROBE = 128

FLOAT32 = torch.finfo(torch.float32)


def scale_by_temperature(
    scores: torch.Tensor, row_max: torch.Tensor, temperature: Sequence[float]
) -> torch.Tensor:
    """A new (S, V) tensor: (scores - row_max) / temperature, each row's top token at 0.

    `row_max` (S,) must be finite. A temperature below float32's smallest normal number acts as
    that number (every token not tied with the top one then weighs 0: the greedy limit); one
    above float32's largest acts as that (every finite score weighs the same).
    """
    clamped = [min(max(t, FLOAT32.tiny), FLOAT32.max) for t in temperature]
    shifted = scores - row_max[:, None]  # (S, V), <= 0
    return shifted.div_(column(clamped, scores.device))


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


def keep_top_p(scaled: torch.Tensor, top_p: Sequence[float]) -> None:
    """In place: -inf every token outside its row's nucleus (`scaled` as scale_by_temperature
    returns it, top_k applied).

    A token is in the nucleus when the mass of the tokens with a higher score is below top_p, so
    tied tokens are kept or dropped together, and the most likely token always is (a top_p that
    rounds to 0 in float32 keeps it alone). Tokens are ranked by score, not by probability:
    scores still tell apart tokens whose float32 probabilities round to the same value (a high
    temperature). A full sort of V tokens costs ~3 ms per row on a CPU core, so the nucleus is
    first looked for among each row's `NUCLEUS_PROBE` best tokens (one batched topk), which hold
    it whenever their mass reaches top_p; only the other rows are sorted, and then only their
    candidates.
    """
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    sub, index = _take_rows(scaled, rows)  # (P, V)
    probs = torch.softmax(sub, dim=-1)  # (P, V)
    p_col = column([top_p[i] for i in rows], scaled.device)  # (P, 1)
    ranked = torch.topk(sub, min(NUCLEUS_PROBE, sub.shape[1]), dim=-1)  # (P, k) best first
    ranked_probs = probs.gather(1, ranked.indices)
    mass_above = ranked_probs.cumsum(dim=-1) - ranked_probs
    in_nucleus = (mass_above < p_col).sum(dim=-1, keepdim=True)  # (P, 1)
    threshold = ranked.values.gather(1, (in_nucleus - 1).clamp_(min=0))  # the last one kept
    beyond_probe = (ranked_probs.sum(dim=-1) < p_col[:, 0]).nonzero().flatten().tolist()
    for j in beyond_probe:
        threshold[j, 0] = _nucleus_threshold(sub[j], probs[j], top_p[rows[j]])
    sub.masked_fill_(sub < threshold, float("-inf"))
    _put_rows(scaled, index, sub)


def keep_min_p(scaled: torch.Tensor, min_p: Sequence[float]) -> None:
    """In place: -inf the tokens less likely than min_p times their row's most likely token.

    With each row's top score at 0 that is a score below log(min_p), a comparison that stays
    exact where the probabilities would round (min_p 1 keeps the top token and its ties only).
    """
    if all(p == 0.0 for p in min_p):
        return
    log_min_p = [math.log(p) if p > 0.0 else -math.inf for p in min_p]
    scaled.masked_fill_(scaled < column(log_min_p, scaled.device), float("-inf"))


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
