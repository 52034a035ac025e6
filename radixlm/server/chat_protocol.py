"""The schema of POST /v1/chat/completions: the request, its tools, tool choice and response
format, strict as every request model (see protocol.py: unknown fields are a 400 naming them,
nothing is coerced). The messages' own schema is `protocol.ChatMessage`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from radixlm.server.protocol import (
    MAX_LOGPROBS,
    ChatMessage,
    ParamError,
    SamplingRequest,
    _Strict,
)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; compiled by the route
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedFunction(_Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1)


class AllowedToolsChoice(_Strict):
    """Calls narrowed to some of the tools, every tool still in the prompt."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only there')
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the model's chat template renders the messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool | None = None
    return_cache_report: bool = False  # why the cache missed: docs/observatory.md

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError(
                "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs to be true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def tool_choice_value(self) -> object:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, BaseModel) else choice
