"""What one step computes, as the scheduler plans it: each request's share (ScheduledRequest),
the whole plan (SchedulerOutput), and after the forward pass the rows to sample (SampleRow).

Logits rows come in request order: one per request (its last computed token), then one per draft
token of a request that verifies a draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from radixlm.engine.request import Request
from radixlm.engine.speculate import Draft


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: it computes all_ids[start : start + extend_len], and with
    a draft the KV of the draft's tokens after them (verify rows)."""

    req: Request
    start: int  # req.computed_len when scheduled
    extend_len: int
    new_slots: np.ndarray  # one in-flight slot per computed token, then one per draft token
    draft: Draft | None = None

    @property
    def is_output_token(self) -> bool:
        """It computes the KV of one output token, the one sampled last: what the engine counts
        as a decode token and commits only when the request ends (a resumed request recomputing
        its outputs is a prefill). The model's own rule for a decode row is wider
        (`ForwardBatch.is_decode`: a prompt's last token over a cached prefix is one too)."""
        return self.extend_len == 1 and self.start >= self.req.prompt_len

    @property
    def num_rows(self) -> int:
        """Its logits rows: the last computed token's, then one per draft token."""
        return 1 + (len(self.draft.tokens) if self.draft else 0)

    @property
    def new_tokens(self) -> list[int]:
        """The token ids it puts through the forward pass: its own, then the draft's."""
        ids = self.req.all_ids[self.start : self.start + self.extend_len]
        return ids + list(self.draft.tokens) if self.draft else ids

    @property
    def num_tokens(self) -> int:
        """Tokens it puts through the forward pass (the token budget's unit)."""
        return self.extend_len + self.num_rows - 1


class SampleRow(NamedTuple):
    """A request whose next token is sampled from `row` of the step's logits; with a draft,
    row + j samples the token after the draft's first j tokens."""

    req: Request
    row: int
    draft: Draft | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # admitted for the first time
