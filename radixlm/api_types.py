"""The public request types: how a request samples, and what it returns. Torch-free.

`SamplingParams` is shared by the offline API, the engine and the server; it validates itself on
construction, so every later stage may trust it. `RequestOutput` is what the offline API returns
(one `CompletionOutput` per sample); `StreamDelta` is one step's increment of a running request
(what the AsyncEngine streams); the delta with a sample's first token carries `FirstTokenTimes`,
the engine's part of that request's timeline. The engine's own view of a request is
`radixlm.engine.request.Request`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # the grammar library is the agents' business, imported where it is used
    from radixlm.agents.grammar import GrammarMatcher


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
    # How long its KV is worth keeping (OpenAI's prompt_cache_retention): "in_memory" never
    # goes to the disk tier, "24h" is written there when the request finishes, None lets the
    # cache decide (docs/cache.md). Without a disk tier both keep it in RAM, as always.
    cache_retention: Literal["in_memory", "24h"] | None = None

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
        _check(
            self.cache_retention in (None, "in_memory", "24h"),
            f"cache_retention must be 'in_memory', '24h' or None, got {self.cache_retention!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# Why an output ended: "stop" (eos, a stop token or a stop string), "length" (max_tokens),
# "abort" (the caller stopped it), "error" (it failed; `error` says why). OpenAI's names.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability under the model's raw distribution, and the most
    likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queue_s: float  # arrival -> first scheduled
    ttft_s: float  # arrival -> first output token
    total_s: float  # arrival -> finished


@dataclass(frozen=True)
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    # draft tokens verified for this sample and how many of them it kept (engine/speculate.py)
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
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
class FirstTokenTimes:
    """Where a sample's first token spent its time in the engine thread. Instants are
    `time.perf_counter()` seconds (one clock for every thread of the process); the rest are
    durations in seconds. Only this request's own waits and work: nothing here says what else
    was in its steps (the server's timeline shows it to the request's own caller)."""

    received: float  # the request reached the engine thread (add_request ran)
    scheduled: float  # admitted into its first step
    sampled: float  # its first token drawn
    match_s: float  # looking its prefix up in the cache at admission
    forward_s: float  # the forward passes it was in, up to its first token
    num_forwards: int
    sample_s: float  # the sampler call that drew its first token
    detokenize_s: float  # that token's text decided (detokenizer, stop strings)


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
    # draft tokens verified for this sample so far and those it kept; None: speculation off
    drafted_tokens: int | None = None
    accepted_tokens: int = 0
    first_token: FirstTokenTimes | None = None  # on the delta carrying the first token only
