"""Requests: how a request samples (SamplingParams), its state in the engine, and what it returns.

`SamplingParams` is shared by the offline API, the engine and the server; it validates itself on
construction, so every later stage may trust it. `Request` is one sequence inside the engine: its
token ids, how many of them have KV in the pool, and which slots hold that KV. `RequestOutput` is
what callers get back; `StreamDelta` is one step's increment of a running request.

A request's tokens are `all_ids = prompt + output`. Its KV covers `all_ids[:num_computed]` and lives
in `slots`; the first `cached_len` of those slots belong to the radix tree (the request holds a
lock on `node`, the tree node ending there), the rest are in flight (owned by the request).
Each step computes `all_ids[num_computed : num_computed + k]`; when that reaches the end of
`all_ids`, the step's logits sample the next token. The scheduler moves these four fields and
nothing else does. Prefill and decode are the same operation
with different k.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # the engine's types; importing them here at run time would be a cycle
    from radixlm.agents.grammar import GrammarMatcher
    from radixlm.cache.tree_node import TreeNode
    from radixlm.detokenizer import OutputStream
    from radixlm.engine.sampler import SamplingState


class Constraint(Protocol):
    """A grammar every sample of a request follows (`radixlm.agents.grammar` builds them)."""

    def new_matcher(self) -> GrammarMatcher: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's output and when to stop it.

    temperature 0 means greedy (argmax). `top_k`/`logprobs`/`seed` of None mean "off"/"unseeded".
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias)
    min_tokens: int = 0  # end-of-sequence and stop ids are banned until this many outputs
    constraint: Constraint | None = None  # a grammar every sample's output follows

    def __post_init__(self) -> None:
        # Accept lists for the tuple fields (frozen dataclasses need object.__setattr__).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        _check(all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be >= 0")
        _check(
            all(math.isfinite(b) for _, b in self.logit_bias), "logit_bias values must be finite"
        )
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens], got {self.min_tokens}",
        )
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k is None or self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(all(s for s in self.stop), "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued; holds no slots and no lock
    RUNNING = "running"  # admitted; holds a lock on `node` and its in-flight slots
    FINISHED = "finished"  # done; every slot handed to the tree or freed


FinishReason = str  # "stop" (eos, stop token or stop string), "length", "abort", "error"


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass(eq=False)
class Request:
    """One sequence in the engine (a request with n > 1 becomes n of these)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None = None  # cache_salt: requests in different namespaces share nothing
    index: int = 0  # which of the request's n samples this is
    arrival_time: float = field(default_factory=time.perf_counter)

    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    all_ids: list[int] = field(init=False)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    # KV bookkeeping (see the module docstring). One writer: the Scheduler, when it admits,
    # postprocesses, retracts or removes the request; the rest of the engine only reads them.
    node: TreeNode | None = None
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    cached_len: int = 0
    num_computed: int = 0
    cached_tokens: int | None = None  # prompt tokens served from the cache at first admission

    # Forks of an n > 1 request wait here until the first sample's prompt is computed.
    forks: list[Request] = field(default_factory=list)

    # Timings (perf_counter seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Scheduling state while waiting: the key admission matches, and the cached-prefix length
    # the tree had for it at `hint_version` (re-peeked only when the tree changed).
    lookup_key: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    match_hint: int = 0
    hint_version: object = None
    wait_steps: int = 0  # scheduling passes spent waiting (the LPM age bound)

    # Per-request sampling and text state, set by the engine right after construction.
    sampling: SamplingState = field(init=False, repr=False)
    text: OutputStream = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.all_ids)

    @property
    def remaining_len(self) -> int:
        """Tokens whose KV is not computed yet (1 while decoding)."""
        return len(self.all_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queue_s: float  # arrival -> first scheduled
    ttft_s: float  # arrival -> first output token
    total_s: float  # arrival -> finished


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The result of a finished request (LLM.generate) or its state so far."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int  # prompt tokens served from the cache (first sample)
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to one sample of a request (the AsyncEngine streams these)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
