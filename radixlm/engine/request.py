"""Request: one sequence inside the engine, and the public RequestOutput built from its samples.

A request's tokens are `all_ids = prompt + output`. Its KV covers `all_ids[:computed_len]` and
lives in `slots`; the first `cached_len` of those slots belong to the radix tree (the request
holds a lock on `node`, the tree node ending there), the rest are in flight (owned by the
request). Each step computes `all_ids[computed_len : computed_len + k]`; when that reaches the
end of `all_ids`, the step's logits sample the next token. Prefill and decode are the same
operation with different k.

A step that verifies a draft (engine/speculate.py) also computes the KV of the drafted tokens,
into `draft_slots` (in flight, owned by the request): each draft token the model accepts moves
its slot to `slots`, and whatever is left is freed before the step ends.

One writer per field: the Scheduler moves the KV fields (`node`, `slots`, `cached_len`,
`computed_len`, `draft_slots`, `forks`), the scheduling state and `state`; the Speculator keeps
`speculation`; the Engine appends sampled tokens and finishes the request. The constructor
builds everything else a request carries: its sampling state (seeded stream, grammar matcher)
and its output stream (text and why it ends).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixlm.api_types import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from radixlm.cache.tree_node import TreeNode
from radixlm.detokenizer import OutputStream
from radixlm.engine.sampler import SamplingState
from radixlm.engine.speculate import DraftState
from radixlm.tokenizer import Tokenizer


@dataclass
class FirstTokenWork:
    """What a sample spent before its first token, added up by the engine thread as it happens
    (seconds; the scheduler adds the match, the engine the rest) and frozen into the first
    token's `FirstTokenTimes`."""

    match_s: float = 0.0
    forward_s: float = 0.0
    num_forwards: int = 0
    sample_s: float = 0.0
    detokenize_s: float = 0.0


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued; holds no slots and no lock
    RUNNING = "running"  # admitted; holds a lock on `node` and its in-flight slots
    FINISHED = "finished"  # done; every slot handed to the tree or freed


class Request:
    """One sequence in the engine (a request with n > 1 becomes n of these, `index` 0..n-1)."""

    def __init__(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        namespace: str | None = None,  # cache_salt: different namespaces share nothing
        index: int = 0,
    ) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.namespace = namespace
        self.index = index
        self.arrival_time = time.perf_counter()

        self.state = RequestState.WAITING
        self.output_ids: list[int] = []
        self.all_ids = list(self.prompt_ids)
        self.logprobs: list[TokenLogprob] = []  # one per output token when params.logprobs
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

        # KV (see the module docstring); written by the Scheduler only.
        self.node: TreeNode | None = None
        self.slots = np.empty(0, dtype=np.int64)
        self.cached_len = 0
        self.computed_len = 0
        self.draft_slots = np.empty(0, dtype=np.int64)  # a verify step's draft rows, in flight
        # Prompt tokens served from the cache at first admission (None until admitted).
        self.cache_hit_len: int | None = None
        # Forks of an n > 1 request wait here until the first sample's prompt is computed.
        self.forks: list[Request] = []

        # Scheduling state while waiting: the key admission matches, and the cached-prefix
        # length the tree had for it at `hint_version` (re-peeked only when the tree changed).
        self.lookup_key = np.empty(0, dtype=np.int64)
        self.match_hint = 0
        self.hint_version: object = None
        self.wait_steps = 0  # scheduling passes spent waiting (the LPM age bound)
        self.speculation: DraftState | None = None  # its drafting, once it drafted

        # Timings (perf_counter seconds).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.first_token_work = FirstTokenWork()  # the timeline's engine part, until then

        # The sampler reads the token lists in place; the stream decides when the output ends.
        eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        stop_ids = eos | frozenset(params.stop_token_ids)  # what min_tokens holds back
        self.sampling = SamplingState(params, self.prompt_ids, self.output_ids, index, stop_ids)
        self.output_stream = OutputStream(tokenizer, params)

    def __repr__(self) -> str:
        return (
            f"Request({self.rid!r}, index={self.index}, {self.state.value}, "
            f"prompt_len={self.prompt_len}, output_len={len(self.output_ids)}, "
            f"computed_len={self.computed_len}, cached_len={self.cached_len})"
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.all_ids)

    @property
    def remaining_len(self) -> int:
        """Tokens whose KV is not computed yet (1 while decoding)."""
        return len(self.all_ids) - self.computed_len

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


def request_output(rid: str, samples: Sequence[Request]) -> RequestOutput:
    """The public result of a request's samples (finished, or their state so far)."""
    first = samples[0]
    metrics = None
    if first.finished_time is not None:
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            queue_s=(first.first_scheduled_time or first.finished_time) - first.arrival_time,
            ttft_s=(first.first_token_time or first.finished_time) - first.arrival_time,
            total_s=max(r.finished_time or 0.0 for r in samples) - first.arrival_time,
        )
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=first.prompt_ids,
        outputs=[
            CompletionOutput(
                index=r.index,
                text=r.output_stream.text,
                token_ids=list(r.output_ids),
                finish_reason=r.finish_reason,
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                drafted_tokens=r.speculation.drafted if r.speculation else 0,
                accepted_tokens=r.speculation.accepted if r.speculation else 0,
            )
            for r in samples
        ],
        cached_tokens=first.cache_hit_len or 0,
        metrics=metrics,
        error=next((r.error for r in samples if r.error), None),
    )
