"""ForwardBatch: the complete description of one forward pass, passed to the model as an argument.

Requests are laid out back to back. For request i with `prefix_len_i` tokens already in the pool
(its cached prefix, or what earlier steps computed) and `extend_len_i` new tokens:

    input_ids   [ r0 new tokens | r1 new tokens | ... ]          (T,)  T = sum(extend_lens)
    positions   [ p0 .. p0+e0-1 | p1 .. p1+e1-1 | ... ]          (T,)  p_i = prefix_len_i
    out_slots   [ where each new token's K/V is written ]        (T,)
    seq_slots[i] = prefix slots of r_i + its out_slots           (prefix_len_i + extend_len_i,)

Each new token attends causally to its request's prefix and to the new tokens before it. A request
is a decode (`is_decode`) when it has one new token over a non-empty prefix: one query row against
pool slots, which attention batches into one decode call; a step whose every request is a decode
(`is_pure_decode`) may run its whole layer loop in one native call. The model never keeps state
between calls: everything it needs is here and in the KV pool.

Verify chains (speculative decoding): a request built with `verify=True` has its new tokens laid
out as a chain of decode rows instead of one extend, row j over the prefix and the chain's rows
before it, and every row returns logits. Each row is then an ordinary decode (one query row, the
decode kernels, the same per-row arithmetic as a decode step), so the model gives row j the bits
that decoding those tokens one step at a time would give it; `chains` tells attention which rows
form one chain (model/verify_rows.py lays them out so that this holds).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class VerifyChain(NamedTuple):
    """Rows [first, first + num_rows) of a batch decode one request's tokens in a chain: row
    first + j sees the `prefix_len` slots of the prefix and rows first .. first + j."""

    first: int
    num_rows: int
    prefix_len: int


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_slots: torch.Tensor  # (T,) int64 pool slots receiving the new K/V
    seq_slots: list[torch.Tensor]  # per request: (prefix_len + extend_len,) int64 slots attended
    extend_lens: list[int]  # per request: number of new tokens
    prefix_lens: list[int]  # per request: tokens already in the pool before this step
    logits_indices: torch.Tensor  # (R,) rows of the T new tokens whose logits are returned
    chains: tuple[VerifyChain, ...] = ()  # requests (rows here) that are one verify chain

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @functools.cached_property
    def is_decode(self) -> tuple[bool, ...]:
        """Per request: one new token over a non-empty prefix. The model's one definition of a
        decode row; the engine's `ScheduledRequest.is_output_token` implies it, and a prompt's
        last token over a cached prefix is one too (the same single query row), as is every row
        of a verify chain."""
        return tuple(e == 1 and p > 0 for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def is_pure_decode(self) -> bool:
        """Every request is a decode (a one-token prompt with nothing cached is not)."""
        return all(self.is_decode)

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        prefix_slots: Sequence[np.ndarray],
        new_slots: Sequence[np.ndarray],
        all_logits: bool = False,
        device: str | torch.device = "cpu",
        verify: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Pack requests into a batch.

        new_tokens[i]: request i's new token ids; prefix_slots[i]: the slots of its tokens already
        in the pool (positions 0..prefix_len-1); new_slots[i]: one slot per new token, already
        allocated by the caller. Logits are returned for the last new token of each request, or
        for every new token when `all_logits` (tests compare full prefills).

        verify[i] (requests with a non-empty prefix): lay request i out as a verify chain, one
        decode row per new token, each returning logits. The logits rows stay in request order:
        a chain of e tokens gives e consecutive rows where a plain request gives one (or its
        extend_len with `all_logits`).
        """
        if not (len(new_tokens) == len(prefix_slots) == len(new_slots)) or not new_tokens:
            raise ValueError("new_tokens, prefix_slots, new_slots: equal non-empty lists")
        if verify is not None and any(verify):
            rows = _chain_rows(new_tokens, prefix_slots, new_slots, verify)
            batch = cls.build(*rows, all_logits=all_logits, device=device)
            return dataclasses.replace(batch, chains=_chains(new_tokens, prefix_slots, verify))
        extend_lens = [len(t) for t in new_tokens]
        prefix_lens = [len(s) for s in prefix_slots]
        for i, (e, s) in enumerate(zip(extend_lens, new_slots)):
            if e == 0 or e != len(s):
                raise ValueError(f"request {i}: {e} new tokens but {len(s)} new slots")
        ids = np.fromiter((t for toks in new_tokens for t in toks), dtype=np.int64)
        positions = np.concatenate(
            [np.arange(p, p + e, dtype=np.int64) for p, e in zip(prefix_lens, extend_lens)]
        )
        out = np.concatenate([np.asarray(s, dtype=np.int64) for s in new_slots])
        seq_slots = [
            torch.from_numpy(np.concatenate([np.asarray(p, np.int64), np.asarray(n, np.int64)]))
            for p, n in zip(prefix_slots, new_slots)
        ]
        ends = np.cumsum(extend_lens)
        logits_rows = np.arange(int(ends[-1])) if all_logits else ends - 1
        return cls(
            input_ids=torch.from_numpy(ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            out_slots=torch.from_numpy(out).to(device),
            seq_slots=[s.to(device) for s in seq_slots],
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            logits_indices=torch.from_numpy(np.asarray(logits_rows, dtype=np.int64)).to(device),
        )


def _chain_rows(
    new_tokens: Sequence[Sequence[int]],
    prefix_slots: Sequence[np.ndarray],
    new_slots: Sequence[np.ndarray],
    verify: Sequence[bool],
) -> tuple[list[Sequence[int]], list[np.ndarray], list[np.ndarray]]:
    """The requests with each verified one split into its decode rows: row j's prefix is the
    request's prefix and its first j new slots."""
    if len(verify) != len(new_tokens):
        raise ValueError(f"verify has {len(verify)} flags for {len(new_tokens)} requests")
    tokens: list[Sequence[int]] = []
    prefixes: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    for toks, prefix, new, chained in zip(new_tokens, prefix_slots, new_slots, verify):
        if not chained:
            tokens.append(toks)
            prefixes.append(prefix)
            slots.append(new)
            continue
        if len(prefix) == 0:
            raise ValueError("a verify chain needs a prefix: its rows are decode rows")
        if len(toks) != len(new):
            raise ValueError(f"{len(toks)} new tokens but {len(new)} new slots")
        whole = np.concatenate([np.asarray(prefix, np.int64), np.asarray(new, np.int64)])
        for j, token in enumerate(toks):
            tokens.append([token])
            prefixes.append(whole[: len(prefix) + j])
            slots.append(whole[len(prefix) + j : len(prefix) + j + 1])
    return tokens, prefixes, slots


def _chains(
    new_tokens: Sequence[Sequence[int]], prefix_slots: Sequence[np.ndarray], verify: Sequence[bool]
) -> tuple[VerifyChain, ...]:
    """Where each verified request's rows landed (as `_chain_rows` laid them out)."""
    chains, row = [], 0
    for toks, prefix, chained in zip(new_tokens, prefix_slots, verify):
        if chained:
            chains.append(VerifyChain(row, len(toks), len(prefix)))
            row += len(toks)
        else:
            row += 1
    return tuple(chains)
