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
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixlm.agents.chat import ChatAgents, ChatOutputs, ChatPlan, call_deltas, finish_reason
from radixlm.agents.grammar import Constraint
from radixlm.agents.tools import ToolChoice
from radixlm.engine.engine import QueueFullError
from radixlm.observatory.routes import with_cache_report
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

    agents = ChatAgents(state.engine.tokenizer, state.limits.vocab_size)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, state, ChatCompletionRequest)
        _check_model(state, body.model)
        namespace = state.tenancy.namespace(request, body.cache_salt)
        plan = await _chat_plan(agents, body)
        render = functools.partial(agents.prompt_ids, tools=plan.tools, namespace=namespace)
        prompt = await state.admission.chat_ids(body.messages, render)
        top = (body.top_logprobs or 0) if body.logprobs else None
        header = _header(state, body, "chat", top, [prompt])
        params = _sampling_params(
            state, body, [prompt], body.token_limit, top, "messages", plan.constraint
        )
        outputs = ChatOutputs(agents, plan, namespace)
        report = None
        if body.return_cache_report:  # explained only when asked: no cost for the others
            report = await state.observatory.explain_chat(
                prompt, namespace, agents.renderer, body.template_messages, plan.tools
            )
        response = await _respond(
            request, state, body, [prompt], params, header, "messages", outputs
        )
        return with_cache_report(response, report) if body.return_cache_report else response

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


async def _chat_plan(agents: ChatAgents, body: ChatCompletionRequest) -> ChatPlan:
    """Tools and grammar of a chat request (compiling blocks: off the event loop)."""
    response_format = body.response_format.to_dict() if body.response_format else None
    if not body.tools and body.tool_choice is None and response_format is None:
        return ChatPlan([], ToolChoice("none"), None)  # a plain chat: nothing to compile
    try:
        return await asyncio.to_thread(
            agents.plan, body.tool_dicts, body.tool_choice_value, body.parallel_tool_calls,
            response_format,
        )  # fmt: skip
    except ValueError as exc:
        message = str(exc)
        param = next((p for p in ("tool_choice", "json_schema") if p in message), "tools")
        param = "response_format" if param == "json_schema" else param
        raise APIError(400, message, param=param) from exc


def _sampling_params(
    state: ServerState,
    body: SamplingRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """The engine's params; max_tokens defaults to what the context and the pool leave."""
    vocab = state.limits.vocab_size
    bad = next((t for t, _ in body.logit_bias_pairs if t >= vocab), None)
    if bad is not None:
        message = f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})"
        raise APIError(400, message, param="logit_bias")
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
            logit_bias=body.logit_bias_pairs,
            min_tokens=body.min_tokens,
            constraint=constraint,
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
    outputs: ChatOutputs | None = None,
) -> Response:
    namespace = outputs.namespace if outputs else state.tenancy.namespace(request, body.cache_salt)
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
        chunks = _stream(gen, header, body.include_usage, state.tenancy.reported, outputs)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        results = await _until_disconnected(request, lambda: _collect(gen, len(prompts) * body.n))
    finally:
        await gen.aclose()
    failed = next((r for r in results if r.finish_reason in ("abort", "error")), None)
    if failed is not None:
        status = 503 if failed.finish_reason == "abort" else 500
        raise APIError(status, failed.error or ABORTED)
    for result in results if outputs else ():
        assert outputs is not None
        content, calls = outputs.message("".join(result.text), result.token_ids)
        if calls:
            result.content, result.tool_calls = content, [c.to_openai() for c in calls]
            result.finish_reason = finish_reason(result.finish_reason, made_calls=True)
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
    outputs: ChatOutputs | None = None,
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
            chunk = ChoiceResult.of(choice)
            if outputs is not None:  # chat: tool calls parsed out of the text as it streams
                _parse_chunk(outputs, chunk)
            if not (first or chunk.text[0] or chunk.tool_calls or d.logprobs or d.finish_reason
                    or header.prompts):  # fmt: skip
                continue  # text held back (an incomplete character, a stop string, a tag)
            offset = offsets.get(choice.index, 0)
            yield _sse(stream_chunk(header, chunk, offset, first, include_usage))
            started.add(choice.index)
            offsets[choice.index] = offset + len(chunk.text[0])
        if include_usage:
            yield _sse(usage_chunk(header, reported(gen.usage)))
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()


def _parse_chunk(outputs: ChatOutputs, chunk: ChoiceResult) -> None:
    """Replace a chunk's text by the content and call deltas the tool-call parser decides."""
    piece = outputs.delta(chunk.index, chunk.text[0], chunk.token_ids)
    text, calls = piece.content, call_deltas(piece)
    if chunk.finish_reason is not None:
        rest, made_calls = outputs.finish(chunk.index)
        text, calls = text + rest.content, calls + call_deltas(rest)
        chunk.finish_reason = finish_reason(chunk.finish_reason, made_calls)
    chunk.text, chunk.tool_calls = [text], calls or None


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
