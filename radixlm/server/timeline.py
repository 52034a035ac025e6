"""A request's timeline: where its time went, from the moment its body began to arrive to the
moment its first token's bytes were handed to the connection, stage by stage. The stages add up
to the whole; nothing falls between two of them:

    arrived ─ body ─ validation ─ prompt ─────────────────────── submit ─ wake ─ queue ─╮
                                  (template, tokenization,                  (cache_match)
                                   prompt_other: tools, thread hops)                    │
    ╭───────────────────────────────────────────────────────────────────────────────────╯
    ╰ forward ... step_other ─ sampling ─ detokenization ─ to_loop ─ write   (first token sent)

    body            the request body read (BodyLimitMiddleware's limits)
    validation      the schema, the model name, the field limits, the namespace
    template        the chat template rendered (chat only)
    tokenization    text to token ids (only what the renderer's memo does not already hold)
    prompt_other    the rest of getting the prompt: planning tools and grammars, the tokenizer
                    threads' queue and the hops to them and back
    submit          sampling parameters, the request's header, up to handing it to the engine
    wake            the event loop to the engine thread: the command waits for the step running
                    then, and for the thread to wake
    cache_match     the prefix looked up in the cache at admission
    queue           waiting to be admitted, the match aside
    forward         the forward passes the request was in, up to its first token
    step_other      the rest of those steps: building batches, committing KV, and between two
                    chunks of a long prefill, whatever ran in between
    sampling        the sampler call that drew the first token
    detokenization  that token's text, stop strings checked
    to_loop         the engine thread back to the event loop (the step's other outputs, the hop)
    write           the SSE chunk built and written (a stream only: a JSON answer is written
                    once every token is there, so its timeline ends when the first token is in)

Engine instants come from `time.perf_counter()` in the engine thread, the others from the same
clock in the event loop. Every request is timed; the stages go to /metrics histograms
(`radixlm_request_stage_seconds`), and to the response itself when it sets `return_timeline`:
a JSON answer gets a top-level "timeline", a stream a chunk with no choices before `[DONE]`
(the usage chunk, when it asks for usage), since its first token's write is known only after
it. A /v1/completions batch gets a list, one per prompt; for n > 1 the first sample's.

Rule: a timeline holds the times its own request waited and the count of its own forward
passes, nothing else: no batch sizes, no other request's tokens or queue position. Its times
add up to the TTFT its caller measures anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.api_types import FirstTokenTimes

STAGES = (
    "body", "validation", "template", "tokenization", "prompt_other", "submit", "wake",
    "cache_match", "queue", "forward", "step_other", "sampling", "detokenization", "to_loop",
    "write",
)  # fmt: skip
SCOPE_KEY = "radixlm.clock"  # where a request's clock lives in its ASGI scope's state


@dataclass
class _FirstToken:
    engine: FirstTokenTimes
    delivered: float  # the event loop had it
    written: float | None = None  # its chunk was handed to the connection


@dataclass
class RequestClock:
    """The instants and durations of one HTTP request, written as it goes (the event loop, and
    the tokenizer thread for the prompt's costs, before the loop reads them)."""

    arrived: float = field(default_factory=time.perf_counter)
    body_read: float | None = None
    validated: float | None = None
    template_s: float = 0.0
    tokenize_s: float = 0.0
    prompt_ready: float | None = None
    submitted: float | None = None
    first_tokens: dict[int, _FirstToken] = field(default_factory=dict)  # per prompt index

    def mark_validated(self) -> None:
        self.validated = time.perf_counter()

    def mark_prompt_ready(self) -> None:
        self.prompt_ready = time.perf_counter()

    def add_prompt_costs(self, template_s: float, tokenize_s: float) -> None:
        self.template_s += template_s
        self.tokenize_s += tokenize_s

    def mark_submitted(self) -> None:
        if self.submitted is None:
            self.submitted = time.perf_counter()

    def first_token(self, prompt: int, times: FirstTokenTimes) -> None:
        """Prompt `prompt`'s first token reached the event loop."""
        if prompt not in self.first_tokens:
            self.first_tokens[prompt] = _FirstToken(times, time.perf_counter())

    def written(self, prompt: int) -> None:
        """A stream chunk of prompt `prompt` was handed to the connection."""
        first = self.first_tokens.get(prompt)
        if first is not None and first.written is None:
            first.written = time.perf_counter()

    def stages(self, prompt: int = 0) -> dict[str, float | None] | None:
        """Seconds per stage (None: not measured, `write` of a JSON answer), or None before the
        prompt's first token."""
        first = self.first_tokens.get(prompt)
        if first is None or None in (self.body_read, self.submitted):
            return None
        e = first.engine
        body_read, submitted = self.body_read or 0.0, self.submitted or 0.0
        validated = self.validated or body_read
        ready = self.prompt_ready or validated
        return {
            "body": body_read - self.arrived,
            "validation": validated - body_read,
            "template": self.template_s,
            "tokenization": self.tokenize_s,
            "prompt_other": ready - validated - self.template_s - self.tokenize_s,
            "submit": submitted - ready,
            "wake": e.received - submitted,
            "cache_match": e.match_s,
            "queue": e.scheduled - e.received - e.match_s,
            "forward": e.forward_s,
            "step_other": e.sampled - e.scheduled - e.forward_s - e.sample_s,
            "sampling": e.sample_s,
            "detokenization": e.detokenize_s,
            "to_loop": first.delivered - e.sampled - e.detokenize_s,
            "write": None if first.written is None else first.written - first.delivered,
        }

    def timeline(self, prompt: int = 0) -> dict[str, Any] | None:
        """The response's "timeline" for one prompt: milliseconds per stage and in all."""
        stages = self.stages(prompt)
        if stages is None:
            return None
        ms = {k: None if v is None else round(v * 1e3, 3) for k, v in stages.items()}
        total = sum(v for v in stages.values() if v is not None)
        return {
            "first_token_ms": round(total * 1e3, 3),
            "num_forwards": self.first_tokens[prompt].engine.num_forwards,
            "stages_ms": ms,
        }


def clock_of(scope: Scope) -> RequestClock | None:
    """The clock TimelineMiddleware started for this request (None outside the app)."""
    state = scope.get("state")
    return state.get(SCOPE_KEY) if isinstance(state, dict) else None


class StageObserver(Protocol):
    """What hears a finished request's stages (the server's metrics)."""

    def observe_stages(self, stages: dict[str, float | None]) -> None: ...


class TimelineMiddleware:
    """Starts every HTTP request's clock as it arrives, notes when its body is all read, and
    hands the stages of every prompt that got a first token to `observer` once the response is
    done (a pure ASGI middleware: streams pass through untouched)."""

    def __init__(self, app: ASGIApp, observer: StageObserver) -> None:
        self.app = app
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        clock = RequestClock()
        scope.setdefault("state", {})[SCOPE_KEY] = clock

        async def timed_receive() -> Message:
            message = await receive()
            whole = message["type"] == "http.request" and not message.get("more_body", False)
            if whole and clock.body_read is None:
                clock.body_read = time.perf_counter()
            return message

        try:
            await self.app(scope, timed_receive, send)
        finally:
            for prompt in clock.first_tokens:
                stages = clock.stages(prompt)
                if stages is not None:
                    self.observer.observe_stages(stages)
