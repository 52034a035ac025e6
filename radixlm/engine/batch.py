"""What a step puts into the model and gives back: the ForwardBatch of the scheduled requests,
and the step's stream deltas, one per sample.

A request with a draft puts its own token and then the draft's through the forward pass as a
verify chain (model/forward_batch.py): decode rows, each with logits, so that every row gets the
bits of the decode step it stands for.
"""

from __future__ import annotations

import dataclasses

import torch

from radixlm.api_types import StreamDelta
from radixlm.engine.step_plan import ScheduledRequest
from radixlm.model.forward_batch import ForwardBatch


def prepare_batch(scheduled: list[ScheduledRequest], device: torch.device) -> ForwardBatch:
    """The step's batch: each request's tokens to compute, a draft's tokens after them as a
    verify chain (its rows are decode rows, each with logits)."""
    return ForwardBatch.build(
        new_tokens=[s.new_tokens for s in scheduled],
        prefix_slots=[s.req.slots for s in scheduled],
        new_slots=[s.new_slots for s in scheduled],
        device=device,
        verify=[s.draft is not None for s in scheduled],
    )


def merge_deltas(deltas: list[StreamDelta]) -> list[StreamDelta]:
    """One delta per sample per step: a verify step's tokens of one sample together, in order."""
    merged: dict[tuple[str, int], StreamDelta] = {}
    for d in deltas:
        key = (d.request_id, d.index)
        before = merged.get(key)
        if before is not None:
            d = dataclasses.replace(
                d,
                text=before.text + d.text,
                token_ids=before.token_ids + d.token_ids,
                logprobs=before.logprobs + d.logprobs,
                first_token=before.first_token or d.first_token,
            )
        merged[key] = d
    return list(merged.values())
