"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models.

A request goes: body within its limits (`body.py`) -> strict schema -> prompt token ids (lengths
checked first, text tokenized on the tokenizer threads: `admission.py`) -> SamplingParams
(max_tokens defaults to what fits the context and the pool) -> its cache namespace
(`tenancy.py`) -> `Generation.start()` (the engine admits it, or a 400 / 503) -> a JSON
response, or an SSE stream of chunks ending with `data: [DONE]`.

A client that goes away is noticed while waiting (a watcher on the ASGI receive channel) or while
streaming (Starlette cancels the body); either way the generation is closed, which aborts the
engine request and returns its KV slots.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixlm.engine.engine import QueueFullError
from radixlm.request import SamplingParams
from radixlm.server.admission import check_fits
from radixlm.server.errors import APIError, ClientDisconnected, error_body, from_validation_error
from radixlm.server.generation import Generation, Usage
from radixlm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from radixlm.server.responses import (
    ChoiceResult,
    Kind,
    ResponseHeader,
    full_response,
    stream_chunk,
    usage_chunk,
)
from radixlm.server.state import ServerState

ABORTED = "The server is shutting down: the request was aborted"  # the only abort a client sees
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, state, CompletionRequest)
        _check_model(state, body.model)
        prompts = [await state.admission.prompt_ids(p) for p in body.prompts]
        header = _header(state, body, "completion", body.logprobs, prompts)
        params = _sampling_params(state, body, prompts, body.max_tokens, body.logprobs, "prompt")
        return await _respond(request, state, body, prompts, params, header, "prompt")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, state, ChatCompletionRequest)
        _check_model(state, body.model)
        prompt = await state.admission.chat_ids(body.messages)
        top = (body.top_logprobs or 0) if body.logprobs else None
        header = _header(state, body, "chat", top, [prompt])
        params = _sampling_params(state, body, [prompt], body.token_limit, top, "messages")
        return await _respond(request, state, body, [prompt], params, header, "messages")

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "radixlm",
            "max_model_len": state.limits.max_context_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    return router


# ---- request -> engine ----------------------------------------------------------------------
async def _parse(request: Request, state: ServerState, model: type[M]) -> M:
    raw = await request.body()  # already read within its limits by BodyLimitMiddleware
    await state.admission.check_json_values(raw, chat=model is ChatCompletionRequest)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    state: ServerState,
    body: SamplingRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
) -> SamplingParams:
    """The engine's params; max_tokens defaults to what the context and the pool leave."""
    limit = state.limits.max_seq_len
    prompt_len = max(len(p) for p in prompts)
    check_fits(state.limits, prompt_len, prompt_param)
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"You requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion), but {state.limits.describe()}; "
            "reduce the prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k if body.top_k is not None and body.top_k > 0 else None,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed,
            stop=tuple(body.stop_list),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            n=body.n,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def _header(
    state: ServerState,
    body: SamplingRequest,
    kind: Kind,
    top_logprobs: int | None,
    prompts: list[list[int]],
) -> ResponseHeader:
    return ResponseHeader(
        id=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=state.model_name,
        kind=kind,
        top_logprobs=top_logprobs,
        token_text=state.token_text,
        n=body.n,
        prompts=tuple(tuple(p) for p in prompts) if body.return_token_ids else None,
    )


# ---- engine -> response ---------------------------------------------------------------------
async def _respond(
    request: Request,
    state: ServerState,
    body: SamplingRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    header: ResponseHeader,
    prompt_param: str,
) -> Response:
    namespace = state.tenancy.namespace(request, body.cache_salt)
    gen = Generation(
        state.engine, prompts, params, header.id, namespace, state.metrics, state.generations
    )
    try:
        await _until_disconnected(request, gen.start)
    except QueueFullError as exc:
        retry = {"Retry-After": str(state.config.retry_after_s)}
        raise APIError(503, f"The server is busy: {exc}", code="queue_full", headers=retry) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param=prompt_param) from exc
    if body.stream:
        chunks = _stream(gen, header, body.include_usage, state.tenancy.reported)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        results = await _until_disconnected(request, lambda: _collect(gen, len(prompts) * body.n))
    finally:
        await gen.aclose()
    failed = next((r for r in results if r.finish_reason in ("abort", "error")), None)
    if failed is not None:
        status = 503 if failed.finish_reason == "abort" else 500
        raise APIError(status, failed.error or ABORTED)
    return JSONResponse(full_response(header, results, state.tenancy.reported(gen.usage)))


async def _collect(gen: Generation, num_choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult(i) for i in range(num_choices)]
    async for choice in gen:
        results[choice.index].add(choice)
    return results


async def _stream(
    gen: Generation,
    header: ResponseHeader,
    include_usage: bool,
    reported: Callable[[Usage], Usage],
) -> AsyncIterator[str]:
    started: set[int] = set()
    offsets: dict[int, int] = {}  # text offset per choice (completions logprobs)
    try:
        async for choice in gen:
            d = choice.delta
            if d.finish_reason in ("abort", "error"):
                status = 503 if d.finish_reason == "abort" else 500
                yield _sse(error_body(status, d.error or ABORTED))
                return
            first = choice.index not in started
            if not (first or d.text or d.logprobs or d.finish_reason or header.prompts):
                continue  # text held back (an incomplete character or a possible stop string)
            offset = offsets.get(choice.index, 0)
            chunk = ChoiceResult.of(choice)
            yield _sse(stream_chunk(header, chunk, offset, first, include_usage))
            started.add(choice.index)
            offsets[choice.index] = offset + len(d.text)
        if include_usage:
            yield _sse(usage_chunk(header, reported(gen.usage)))
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
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
