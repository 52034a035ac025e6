"""What every generating route does first: the body against its schema, the model's name, and a
chat's tools and grammar planned off the event loop (grammar compilation blocks)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from radixlm.agents.chat import ChatAgents, ChatPlan
from radixlm.agents.tools import ToolChoice
from radixlm.server.errors import APIError, from_validation_error
from radixlm.server.state import ServerState

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, state: ServerState, model: type[M], chat: bool) -> M:
    """The request body as `model`; a 400 naming the first problem. `chat`: the body holds
    messages (their bound on JSON values, not a completion prompt's)."""
    raw = await request.body()  # already read within its limits by BodyLimitMiddleware
    await state.bounds.check_json_values(raw, chat=chat)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


async def plan_chat(
    agents: ChatAgents,
    tools: list[dict[str, Any]] | None,
    tool_choice: object,
    parallel_tool_calls: bool | None,
    response_format: dict[str, Any] | None,
    format_param: str = "response_format",
) -> ChatPlan:
    """Tools and grammar of a chat request; a 400 naming tools, tool_choice or the format."""
    if not tools and tool_choice is None and response_format is None:
        return ChatPlan([], ToolChoice("none"), None)  # a plain chat: nothing to compile
    try:
        return await asyncio.to_thread(
            agents.plan, tools, tool_choice, parallel_tool_calls, response_format
        )
    except ValueError as exc:
        message = str(exc)
        param = next((p for p in ("tool_choice", "json_schema") if p in message), "tools")
        param = format_param if param == "json_schema" else param
        raise APIError(400, message, param=param) from exc
