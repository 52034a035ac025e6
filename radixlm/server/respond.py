"""One queued request's answer: run its `Generation` and turn it into an HTTP response, a JSON
body once every choice finished, or an SSE stream of chunks ending with `data: [DONE]`.

A client that goes away is noticed while waiting (a watcher on the ASGI receive channel) or while
streaming (Starlette cancels the body); either way the generation is closed, which aborts the
engine request and returns its KV slots. Every queued prompt is noted in the observatory's
index (the salt check of later cache reports). A request that sets `return_timeline` gets its
timeline (`timeline.py`) in the JSON body, or in a stream's last chunk before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.agents.chat import ChatOutputs, call_deltas, finish_reason
from radixlm.api_types import SamplingParams
from radixlm.engine.engine import QueueFullError
from radixlm.server.errors import APIError, ClientDisconnected, error_body
from radixlm.server.generation import Generation, Usage
from radixlm.server.protocol import SamplingRequest
from radixlm.server.responses import (
    ChoiceResult,
    ResponseHeader,
    full_response,
    stream_chunk,
    usage_chunk,
)
from radixlm.server.state import ServerState
from radixlm.server.timeline import RequestClock, clock_of

ABORTED = "The server is shutting down: the request was aborted"  # the only abort a client sees
T = TypeVar("T")


async def respond(
    request: Request,
    state: ServerState,
    body: SamplingRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    header: ResponseHeader,
    namespace: str | None,
    prompt_param: str,
    outputs: ChatOutputs | None = None,
    batch: bool = False,
) -> Response:
    """Queue the prompts (a 503 when the queue is full, a 400 the engine refuses) and answer;
    `outputs` parses a chat's tool calls out of its text; `batch`: a completions batch (its
    timeline is a list)."""
    gen = await enqueue(request, state, prompts, params, header.id, namespace, prompt_param)
    timeline = _Timeline(gen.clock, len(prompts), batch) if body.return_timeline else None
    if body.stream:
        reported = state.tenancy.reported
        chunks = _stream(request, gen, header, body.include_usage, reported, outputs, timeline)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        results = await until_disconnected(request, lambda: _collect(gen, len(prompts) * body.n))
    finally:
        await gen.aclose()
    failed = next((r for r in results if r.finish_reason in ("abort", "error")), None)
    if failed is not None:
        status = 503 if failed.finish_reason == "abort" else 500
        raise APIError(status, failed.error or ABORTED)
    for result in results if outputs else ():
        assert outputs is not None
        reply = outputs.message("".join(result.text), result.token_ids, result.finish_reason)
        if reply.calls:
            result.content, result.tool_calls = reply.content, [c.to_openai() for c in reply.calls]
            result.finish_reason = finish_reason(result.finish_reason, made_calls=True)
        elif reply.content != "".join(result.text):  # none parsed: an unclosed call is text
            result.text = [reply.content or ""]
    answer = full_response(header, results, state.tenancy.reported(gen.usage))
    if timeline is not None:
        answer["timeline"] = timeline.value()
    return JSONResponse(answer)


async def enqueue(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    namespace: str | None,
    prompt_param: str,
) -> Generation:
    """The engine queues the prompts (a 503 when its queue is full, a 400 for what it refuses)
    and their generation starts; the prompts are noted for the salt index."""
    gen = Generation(
        state.engine, prompts, params, request_id, namespace, state.metrics, state.generations,
        clock_of(request.scope),
    )  # fmt: skip
    try:
        await until_disconnected(request, gen.start)
    except QueueFullError as exc:
        retry = {"Retry-After": str(state.config.retry_after_s)}
        raise APIError(503, f"The server is busy: {exc}", code="queue_full", headers=retry) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param=prompt_param) from exc
    state.observatory.note(prompts, namespace)
    return gen


async def _collect(gen: Generation, num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult(i) for i in range(num_choices)]
    async for choice in gen:
        results[choice.index].add(choice)
    return results


async def _stream(
    request: Request,
    gen: Generation,
    header: ResponseHeader,
    include_usage: bool,
    reported: Callable[[Usage], Usage],
    outputs: ChatOutputs | None = None,
    timeline: _Timeline | None = None,
) -> AsyncIterator[str]:
    started: set[int] = set()
    offsets: dict[int, int] = {}  # text offset per choice (completions logprobs)
    watcher = asyncio.ensure_future(_abort_on_disconnect(request, gen))
    try:
        async for choice in gen:
            d = choice.delta
            if d.finish_reason in ("abort", "error"):
                status = 503 if d.finish_reason == "abort" else 500
                yield _sse(error_body(status, d.error or ABORTED))
                return
            first = choice.index not in started
            chunk = ChoiceResult.of(choice)
            if outputs is not None:  # chat: tool calls parsed out of the text as it streams
                _parse_chunk(outputs, chunk)
            if not (first or chunk.text[0] or chunk.tool_calls or d.logprobs or d.finish_reason
                    or header.prompts):  # fmt: skip
                continue  # text held back (an incomplete character, a stop string, a tag)
            offset = offsets.get(choice.index, 0)
            yield _sse(stream_chunk(header, chunk, offset, first, include_usage))
            if first and gen.clock is not None:  # resumed: the chunk went to the connection
                gen.clock.written(choice.index // header.n)
            started.add(choice.index)
            offsets[choice.index] = offset + len(chunk.text[0])
        last = usage_chunk(header, reported(gen.usage)) if include_usage else None
        if timeline is not None:
            last = last or {**header.base(chunk=True), "choices": []}
            last["timeline"] = timeline.value()
        if last is not None:
            yield _sse(last)
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        await gen.aclose()


async def _abort_on_disconnect(request: Request, gen: Generation) -> None:
    """Abort a stream's requests once its client has gone. A write to a closed connection fails
    too, but a stream may write nothing for a long time (its text held back while it could
    still end a stop string), and its request must not run on for nobody."""
    await _disconnect(request)
    gen.abort()


class _Timeline:
    """The "timeline" a response carries: one prompt's, or a list for a completions batch."""

    def __init__(self, clock: RequestClock | None, num_prompts: int, batch: bool) -> None:
        self.clock, self.num_prompts, self.batch = clock, num_prompts, batch

    def value(self) -> Any:
        if self.clock is None:
            return [None] * self.num_prompts if self.batch else None
        each = [self.clock.timeline(i) for i in range(self.num_prompts)]
        return each if self.batch else each[0]


def _parse_chunk(outputs: ChatOutputs, chunk: ChoiceResult) -> None:
    """Replace a chunk's text by the content and call deltas the tool-call parser decides."""
    piece = outputs.delta(chunk.index, chunk.text[0], chunk.token_ids)
    text, calls = piece.content, call_deltas(piece)
    if chunk.finish_reason is not None:
        rest, reply = outputs.finish(chunk.index, chunk.finish_reason)
        text, calls = text + rest.content, calls + call_deltas(rest)
        chunk.finish_reason = finish_reason(chunk.finish_reason, bool(reply.calls))
    chunk.text, chunk.tool_calls = [text], calls or None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {compact_json(obj)}\n\n"


def compact_json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it if the client disconnects first (then ClientDisconnected)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientDisconnected()


async def _disconnect(request: Request) -> None:
    """Return once the client has gone away (the body was read already: only this is left)."""
    message = await request.receive()
    while message["type"] != "http.disconnect":
        message = await request.receive()
