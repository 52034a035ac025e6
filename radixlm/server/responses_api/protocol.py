"""The schema of POST /v1/responses, strict as every request model (protocol.py): an unknown
field is a 400 naming it, nothing is coerced.

Declared but refused unless they hold their no-op value, each with a message naming the field:
`background`, `conversation`, `prompt`, `reasoning` (an effort or a summary), `truncation: "auto"`,
`max_tool_calls`, `top_logprobs`, `include` (but "reasoning.encrypted_content": there is never a
reasoning item to include), `context_management`, `prompt_cache_options`. Accepted and
changing nothing: `metadata`, `user`, `safety_identifier`, `prompt_cache_key`, `service_tier`,
`text.verbosity`, `stream_options.include_obfuscation`. `input`, `tools` and `tool_choice` are
read by `items.py`, which names the item or tool it cannot take. Extensions, as the other
routes name them: `cache_salt`, `seed`, `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `logit_bias`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from radixlm.server.protocol import ParamError, _Strict, check_logit_bias

NO_OP_INCLUDES = frozenset({"reasoning.encrypted_content"})


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ParamError(
                "text.format", 'text.format of type "json_schema" needs name and schema'
            )
        return self

    def to_response_format(self) -> dict[str, Any] | None:
        """The same format as Chat Completions' response_format (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": self.schema_, "strict": bool(self.strict)}
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for reasoning models


class Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @property
    def asks(self) -> bool:
        """Whether it asks for reasoning (effort "none" or nothing at all asks nothing)."""
        return self.effort not in (None, "none") or bool(self.summary or self.generate_summary)


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True  # OpenAI's default: a response can be continued unless told otherwise
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    service_tier: str | None = None
    # declared to be refused unless they are no-ops
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    prompt_cache_options: Any = None
    # extensions, named as on the other routes
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias, clamped to +-100

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(bias)

    @field_validator("include")
    @classmethod
    def _check_include(cls, include: list[str] | None) -> list[str] | None:
        refused = [value for value in include or () if value not in NO_OP_INCLUDES]
        if refused:
            raise ValueError(f"{refused[0]!r} is not supported (no item carries it here)")
        return include

    @model_validator(mode="after")
    def _refuse_the_unsupported(self) -> ResponsesRequest:
        refusals = {
            "background": self.background,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "truncation": self.truncation == "auto",
            "max_tool_calls": self.max_tool_calls is not None,
            "top_logprobs": bool(self.top_logprobs),
            "context_management": self.context_management is not None,
            "prompt_cache_options": self.prompt_cache_options is not None,
            "reasoning": self.reasoning is not None
            and any(
                (self.reasoning.effort, self.reasoning.summary, self.reasoning.generate_summary)
            ),
        }
        for name, refused in refusals.items():
            if refused:
                raise ParamError(name, f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.to_response_format() if fmt is not None else None

    @property
    def cache_retention(self) -> Literal["in_memory", "24h"] | None:
        value = self.prompt_cache_retention
        return "in_memory" if value == "in-memory" else value
