"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models.

A request goes: body within its limits (`body.py`) -> strict schema -> prompt token ids (lengths
checked first, text tokenized on the tokenizer threads: `bounds.py`) -> SamplingParams
(max_tokens defaults to what fits the context and the pool) -> its cache namespace
(`tenancy.py`) -> its cache reports started, when asked (`observatory/service.py`) ->
`respond()`: the engine queues it (or a 400 / 503), and a JSON response or an SSE stream answers
(`respond.py`). The request's clock (`timeline.py`) is told when validation and the prompt are
done, and what rendering and tokenizing took.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from radixlm.agents.chat import ChatOutputs
from radixlm.agents.grammar import Constraint
from radixlm.api_types import SamplingParams
from radixlm.observatory.segments import chat_segments
from radixlm.server.chat_protocol import ChatCompletionRequest
from radixlm.server.intake import check_model, parse_body, plan_chat
from radixlm.server.observatory_routes import Reports, start_report, with_cache_report
from radixlm.server.protocol import CompletionRequest, SamplingRequest
from radixlm.server.respond import respond
from radixlm.server.responses import Kind, ResponseHeader
from radixlm.server.sampling import SamplingFields, sampling_params
from radixlm.server.state import ServerState
from radixlm.server.timeline import RequestClock, clock_of

M = TypeVar("M", bound=BaseModel)


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        clock = _clock(request)
        body = await parse_body(request, state, CompletionRequest, chat=False)
        check_model(state, body.model)
        state.bounds.check_fields(body)  # stop, logit_bias: bounded before anything reads them
        clock.mark_validated()
        prompts = [await state.bounds.prompt_ids(p) for p in body.prompts]
        if any(isinstance(p, str) for p in body.prompts):  # text: tokenized on the threads
            clock.add_prompt_costs(0.0, time.perf_counter() - (clock.validated or 0.0))
        clock.mark_prompt_ready()
        header = _header(state, body, "completion", body.logprobs, prompts)
        params = _sampling_params(state, body, prompts, body.max_tokens, body.logprobs, "prompt")
        namespace = state.tenancy.namespace(request, body.cache_salt)
        reports: Reports = []
        if body.return_cache_report:  # explained only when asked: no cost for the others
            reports = [start_report(state, p, namespace) for p in prompts]
        answer = respond(
            request, state, body, prompts, params, header, namespace, "prompt",
            batch=body.is_batch,
        )  # fmt: skip
        return await _with_reports(answer, reports, batch=body.is_batch)

    agents = state.agents

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        clock = _clock(request)
        body = await parse_body(request, state, ChatCompletionRequest, chat=True)
        check_model(state, body.model)
        state.bounds.check_fields(body, body.messages)  # before tools compile or render
        namespace = state.tenancy.namespace(request, body.cache_salt)
        clock.mark_validated()
        response_format = body.response_format.to_dict() if body.response_format else None
        plan = await plan_chat(
            agents, body.tool_dicts or None, body.tool_choice_value, body.parallel_tool_calls,
            response_format,
        )  # fmt: skip

        def render(messages: list[dict[str, Any]]) -> list[int]:  # on a tokenizer thread
            rendered = agents.renderer.prompt(messages, plan.tools, namespace)
            clock.add_prompt_costs(rendered.costs.template_s, rendered.costs.tokenize_s)
            return rendered.ids

        prompt = await state.bounds.chat_ids(body.messages, render)
        clock.mark_prompt_ready()
        top = (body.top_logprobs or 0) if body.logprobs else None
        header = _header(state, body, "chat", top, [prompt])
        params = _sampling_params(
            state, body, [prompt], body.token_limit, top, "messages", plan.constraint
        )
        outputs = ChatOutputs(agents, plan, namespace)
        reports: Reports = []
        if body.return_cache_report:  # explained only when asked: no cost for the others
            segments = functools.partial(
                chat_segments, agents.renderer, body.template_messages, plan.tools
            )
            reports = [start_report(state, prompt, namespace, segments)]
        answer = respond(
            request, state, body, [prompt], params, header, namespace, "messages", outputs
        )
        return await _with_reports(answer, reports)

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


# ---- helpers --------------------------------------------------------------------------------
def _clock(request: Request) -> RequestClock:
    """The request's clock (TimelineMiddleware starts one for every request; a fresh one where
    the app runs without it)."""
    return clock_of(request.scope) or RequestClock()


async def _with_reports(
    answer: Awaitable[Response], reports: Reports, batch: bool = False
) -> Response:
    """The answer, with its cache reports when the request asked (they were started before
    the request was submitted; an answer that fails drops them)."""
    try:
        response = await answer
    except BaseException:
        for task in reports:
            task.cancel()
        raise
    return await with_cache_report(response, reports, batch) if reports else response


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
    fields = SamplingFields(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=tuple(body.stop_list),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        n=body.n,
        logit_bias=body.logit_bias_pairs,
        min_tokens=body.min_tokens,
        cache_retention=body.cache_retention,
    )
    prompt_len = max(len(p) for p in prompts)
    return sampling_params(state, fields, prompt_len, prompt_param, constraint)


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
