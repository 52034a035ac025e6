"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over the same engine,
renderer, grammars and turn memo as Chat Completions.

A request goes: strict schema (`protocol.py`) -> its namespace (`tenancy.py`) -> the stored
response it continues, if any (`store.py`: unknown in this namespace is a 404) -> chat messages
(instructions, the stored conversation, the new input items: `items.py`) -> tools and grammar
planned -> prompt ids from the one renderer, the stored turns spliced in as generated -> the
engine -> a response object or a stream of events (`shapes.py`) -> stored, when `store`.

Continuing a stored response renders its conversation with the ids its prompt and output were
made of, so the new prompt starts with exactly what the tree holds: from the second request of a
chain on, `cached_tokens` is everything the previous one computed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from radixlm.agents.chat import ChatOutputs, Reply
from radixlm.agents.tool_parser import ToolCall
from radixlm.agents.turns import Turn
from radixlm.server.errors import APIError
from radixlm.server.generation import Generation
from radixlm.server.intake import check_model, parse_body, plan_chat
from radixlm.server.protocol import ChatMessage, logit_bias_pairs
from radixlm.server.respond import ABORTED, enqueue, until_disconnected
from radixlm.server.responses_api.items import (
    ItemError,
    chat_tool_choice,
    chat_tools,
    input_messages,
    new_id,
    response_tools,
)
from radixlm.server.responses_api.protocol import ResponsesRequest
from radixlm.server.responses_api.shapes import ResponseEvents, ResponseHeader
from radixlm.server.responses_api.store import StoredResponse
from radixlm.server.sampling import SamplingFields, sampling_params
from radixlm.server.state import ServerState


def responses_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await parse_body(request, state, ResponsesRequest, chat=True)
        check_model(state, body.model)
        state.bounds.check_fields(body)  # input, tools, text.format: before they are read
        namespace = state.tenancy.namespace(request, body.cache_salt)
        previous = _previous(state, namespace, body.previous_response_id)
        try:
            new_input = input_messages(body.input)
            tools = chat_tools(body.tools)
            tool_choice = chat_tool_choice(body.tool_choice)
        except ItemError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        plan = await plan_chat(state.agents, tools, tool_choice, body.parallel_tool_calls,
                               body.response_format, format_param="text.format")  # fmt: skip
        pending = _Pending(
            new_id("resp"), namespace, body.store,
            list(previous.conversation) if previous is not None else [], new_input,
            previous.turns if previous is not None else (),
        )  # fmt: skip

        def render(template: list[dict[str, Any]]) -> list[int]:
            prompt = state.agents.renderer.prompt(template, plan.tools, namespace, pending.known)
            pending.prompt_turns = prompt.turns
            return prompt.ids

        instructions = [] if body.instructions is None else [
            {"role": "system", "content": body.instructions}]  # fmt: skip
        messages = _chat_messages([*instructions, *pending.history, *new_input])
        prompt = await state.bounds.chat_ids(messages, render)
        params = sampling_params(
            state, _fields(body), len(prompt), "input", plan.constraint, "max_output_tokens"
        )
        header = ResponseHeader(pending.id, int(time.time()), state.model_name, body,
                                response_tools(tools))  # fmt: skip
        gen = await enqueue(request, state, [prompt], params, header.id, namespace, "input")
        outputs = ChatOutputs(state.agents, plan, namespace)
        keep = functools.partial(_keep, state, pending)
        if body.stream:
            return StreamingResponse(
                _stream(state, gen, header, outputs, keep), media_type="text/event-stream"
            )
        return await _whole(request, state, gen, header, outputs, keep)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str, cache_salt: str | None = None) -> Any:
        namespace = state.tenancy.namespace(request, cache_salt)
        stored = state.responses.get(namespace, response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.response)

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str, cache_salt: str | None = None) -> Any:
        namespace = state.tenancy.namespace(request, cache_salt)
        if not state.responses.delete(namespace, response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return router


# ---- helpers --------------------------------------------------------------------------------
Keep = Callable[[Reply, dict[str, Any]], None]  # a finished response, to store (or not)


@dataclass
class _Pending:
    """What a response is stored as once its output is known: the conversation it continues
    and its new input, and the turns whose generated ids its prompt holds."""

    id: str
    namespace: str | None
    store: bool
    history: list[dict[str, Any]]  # the stored conversation it continues
    new_input: list[dict[str, Any]]
    known: tuple[Turn, ...]  # the continued conversation's turns, to splice in
    prompt_turns: tuple[Turn, ...] = ()  # the turns the rendered prompt spliced in


def _keep(state: ServerState, pending: _Pending, reply: Reply, response: dict[str, Any]) -> None:
    """Store a finished response (when asked): its conversation ends with its own output."""
    if not pending.store:
        return
    conversation = (*pending.history, *pending.new_input, _assistant_message(reply))
    turns = (*pending.prompt_turns, *([reply.turn] if reply.turn else []))
    stored = StoredResponse(pending.id, conversation, turns, response)
    state.responses.put(pending.namespace, stored)


async def _whole(
    request: Request,
    state: ServerState,
    gen: Generation,
    header: ResponseHeader,
    outputs: ChatOutputs,
    keep: Keep,
) -> Response:
    text: list[str] = []
    ids: list[int] = []
    reason: str | None = None
    error: str | None = None

    async def collect() -> None:
        nonlocal reason, error
        async for choice in gen:
            text.append(choice.delta.text)
            ids.extend(choice.delta.token_ids)
            if choice.delta.finish_reason is not None:
                reason, error = choice.delta.finish_reason, choice.delta.error

    try:
        await until_disconnected(request, collect)
    finally:
        await gen.aclose()
    if reason in ("abort", "error"):
        raise APIError(503 if reason == "abort" else 500, error or ABORTED)
    reply = outputs.message("".join(text), ids, reason)
    usage = state.tenancy.reported(gen.usage)
    response = header.whole(reply.content, reply.calls, reason == "length", usage)
    keep(reply, response)
    return JSONResponse(response)


async def _stream(
    state: ServerState,
    gen: Generation,
    header: ResponseHeader,
    outputs: ChatOutputs,
    keep: Keep,
) -> AsyncIterator[str]:
    events = ResponseEvents(header)
    try:
        for event in events.start():
            yield event
        async for choice in gen:
            d = choice.delta
            if d.finish_reason in ("abort", "error"):
                for event in events.failed(d.error or ABORTED):
                    yield event
                return
            piece = outputs.delta(0, d.text, d.token_ids)
            out = [*events.text(piece.content)]
            for call in piece.calls:
                out += events.call(ToolCall(call.id, call.name, call.arguments))
            if d.finish_reason is not None:
                rest, reply = outputs.finish(0, d.finish_reason)
                out += events.text(rest.content)
                for call in rest.calls:
                    out += events.call(ToolCall(call.id, call.name, call.arguments))
                closing, response = events.finish(d.finish_reason == "length",
                                                  state.tenancy.reported(gen.usage))  # fmt: skip
                keep(reply, response)
                out += closing
            for event in out:
                yield event
    finally:
        await gen.aclose()


def _previous(
    state: ServerState, namespace: str | None, response_id: str | None
) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = state.responses.get(namespace, response_id)
    if stored is None:
        raise _not_found(response_id, "previous_response_id")
    return stored


def _not_found(response_id: str, param: str) -> APIError:
    """Unknown, deleted, dropped or another tenant's: one answer for all of them."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(404, f"{what} with id {response_id!r} not found.", param=param, code=code)


def _chat_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """The conversation as the chat schema's messages (what the bounds measure), each checked
    as a chat request's would be."""
    out = []
    for i, message in enumerate(messages):
        try:
            chat = ChatMessage.model_validate(message)
            chat.check(f"input[{i}]")
        except (ValidationError, ValueError) as exc:
            raise APIError(400, f"Invalid input: {exc}", param="input") from exc
        out.append(chat)
    return out


def _assistant_message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [call.to_openai() for call in reply.calls]
    elif reply.content is None:
        message["content"] = ""
    return message


def _fields(body: ResponsesRequest) -> SamplingFields:
    return SamplingFields(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logit_bias=logit_bias_pairs(body.logit_bias),
        cache_retention=body.cache_retention,
    )
