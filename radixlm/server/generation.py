"""One HTTP request's generation: an engine stream per prompt, merged into one feed of choices.

A /v1/completions request may carry a batch of prompts and every request may ask for n samples;
OpenAI numbers the resulting choices `prompt_index * n + sample_index`. `Generation` runs one
`AsyncEngine.generate` stream per prompt as a task, merges their deltas in arrival order, keeps
the usage counts, feeds the latency metrics and, given the request's clock, notes its submission
and each prompt's first token there (`timeline.py`).

    gen = Generation(engine, prompts, params, "cmpl-1", salt, metrics)
    await gen.start()              # every prompt queued (or the engine's ValueError, raised)
    async for choice in gen: ...   # ChoiceDelta, until every sample finished
    await gen.aclose()             # always: aborts what is still running, its slots come back
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from radixlm.api_types import SamplingParams, StreamDelta
from radixlm.engine.async_engine import AsyncEngine
from radixlm.server.timeline import RequestClock


class LatencyObserver(Protocol):
    """Where per-token latencies go (the server's Prometheus metrics)."""

    def observe_ttft(self, seconds: float) -> None: ...

    def observe_itl(self, seconds: float) -> None: ...

    def observe_finished(self, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass(frozen=True)
class ChoiceDelta:
    index: int  # the OpenAI choice index
    delta: StreamDelta


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache; None: not reported (the server hides it)
    cached_tokens: int | None = 0
    # Draft tokens verified and kept (engine/speculate.py); None: speculation is off
    drafted_tokens: int | None = None
    accepted_tokens: int = 0

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.drafted_tokens is not None:  # a radixlm extension
            out["speculation"] = {
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens
            }  # fmt: skip
        return out


@dataclass
class _Sample:
    completion_tokens: int = 0
    last_token_time: float | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int = 0


@dataclass
class _Prompt:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False  # the engine queued it (its first event arrived)
    samples: dict[int, _Sample] = field(default_factory=dict)


_END = None  # a pump's last event: its prompt's stream is over


class Generation:
    """The merged streams of one HTTP request (see the module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        request_id: str,
        namespace: str | None = None,
        observer: LatencyObserver | None = None,
        registry: set[Generation] | None = None,
        clock: RequestClock | None = None,
    ) -> None:
        self.engine = engine
        self.prompts = [list(p) for p in prompts]
        self.params = params
        self.request_id = request_id
        self.namespace = namespace
        self.observer = observer
        self.registry = registry  # the server's open generations (aborted at shutdown)
        self.clock = clock
        # TTFT counts from the request's arrival (its clock), else from now
        self.arrival = clock.arrived if clock is not None else time.perf_counter()
        self._events: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = (
            asyncio.Queue()
        )
        self._buffered: deque[tuple[int, StreamDelta]] = deque()
        self._state = [_Prompt() for _ in self.prompts]
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(self.prompts)  # prompts whose stream has not ended

    async def start(self) -> None:
        """Submit every prompt; return once each was queued, or raise why one was not."""
        if self.registry is not None:
            self.registry.add(self)
        self._tasks = [
            asyncio.create_task(self._pump(i, prompt)) for i, prompt in enumerate(self.prompts)
        ]
        try:
            while not all(p.started for p in self._state):
                i, event = await self._events.get()
                self._state[i].started = True
                if isinstance(event, BaseException):
                    raise event
                if event is _END:
                    self._open -= 1
                else:
                    self._buffered.append((i, event))
        except BaseException:
            await self.aclose()
            raise

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        while self._buffered:
            yield self._account(*self._buffered.popleft())
        while self._open:
            i, event = await self._events.get()
            if isinstance(event, BaseException):
                raise event
            if event is _END:
                self._open -= 1
            else:
                yield self._account(i, event)

    async def aclose(self) -> None:
        """Cancel every stream still running; the engine aborts them and frees their slots."""
        if self.registry is not None:
            self.registry.discard(self)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def abort(self) -> None:
        """Ask the engine to stop every stream now; each ends with finish_reason "abort".
        Thread-safe and non-blocking (a signal handler may call it)."""
        for i in range(len(self.prompts)):
            self.engine.abort(self._request_id(i))

    @property
    def usage(self) -> Usage:
        samples = [s for p in self._state for s in p.samples.values()]
        drafted = [s.drafted_tokens for s in samples if s.drafted_tokens is not None]
        return Usage(
            prompt_tokens=sum(p.prompt_tokens for p in self._state),
            completion_tokens=sum(s.completion_tokens for s in samples),
            cached_tokens=sum(p.cached_tokens for p in self._state),
            drafted_tokens=sum(drafted) if drafted else None,
            accepted_tokens=sum(s.accepted_tokens for s in samples),
        )

    # ---- helpers ----------------------------------------------------------------------------
    async def _pump(self, i: int, prompt: list[int]) -> None:
        rid = self._request_id(i)
        stream = cast(
            AsyncGenerator[StreamDelta, None],
            self.engine.generate(prompt, self.params, rid, self.namespace),
        )
        if self.clock is not None:
            self.clock.mark_submitted()  # the stream's first step submits it to the engine
        try:
            async for delta in stream:
                if delta.first_token is not None and delta.index == 0 and self.clock is not None:
                    self.clock.first_token(i, delta.first_token)
                self._events.put_nowait((i, delta))
            self._events.put_nowait((i, _END))
        except Exception as exc:  # the engine refused the prompt: start() re-raises it
            self._events.put_nowait((i, exc))
        finally:
            await stream.aclose()

    def _request_id(self, i: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{i}"

    def _account(self, i: int, delta: StreamDelta) -> ChoiceDelta:
        now = time.perf_counter()
        prompt = self._state[i]
        prompt.prompt_tokens = delta.prompt_tokens
        if delta.index == 0:
            prompt.cached_tokens = delta.cached_tokens
        sample = prompt.samples.setdefault(delta.index, _Sample())
        sample.completion_tokens = delta.completion_tokens
        sample.drafted_tokens, sample.accepted_tokens = delta.drafted_tokens, delta.accepted_tokens
        if delta.token_ids and self.observer is not None:
            if sample.last_token_time is None:
                self.observer.observe_ttft(now - self.arrival)
            else:
                gap = (now - sample.last_token_time) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.observer.observe_itl(gap)
        if delta.token_ids:
            sample.last_token_time = now
        if delta.finish_reason is not None and self.observer is not None:
            tokens = prompt.prompt_tokens if delta.index == 0 else 0
            self.observer.observe_finished(tokens, delta.completion_tokens)
        return ChoiceDelta(i * self.params.n + delta.index, delta)
