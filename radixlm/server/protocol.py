"""The request schemas of the OpenAI-compatible routes, strict by construction.

Every model forbids unknown fields (an unknown parameter is a 400 naming it) and validates in
pydantic's strict mode (a string is never coerced into a number). Parameters OpenAI defines that
radixlm does not implement are declared, so a request using them gets "not supported" rather than
"unrecognized", and rejected unless they hold their no-op value. Extensions follow vLLM's names
(`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `cache_salt`,
`return_token_ids`).

What these models guarantee is shape and range; what depends on the loaded model (context length,
vocabulary, pool size) is checked by the route against the model's limits.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16  # samples per prompt; each one holds its own KV slots while decoding
MAX_STOP = 16  # stop strings per request
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request


class ParamError(ValueError):
    """A check that spans fields; `param` names the field the error message is about."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0 mean "off" (vLLM's convention)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; it changes nothing
    return_token_ids: bool = False  # choices carry their token ids (vLLM's extension)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    logit_bias: dict[str, float] | None = None  # declared to be refused when non-empty

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and min(ids) < 0:
            raise ValueError("stop_token_ids must be >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _refuse_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return bias

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. A prompt is text or token ids, or a list of either (a batch)."""

    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # declared to be refused: echoing the prompt is not supported
    best_of: int | None = None  # declared to be refused unless 1
    suffix: str | None = None  # declared to be refused: insertion is not supported

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if not _is_prompt(prompt):
            if isinstance(prompt, list) and prompt and all(_is_prompt(p) for p in prompt):
                if len(prompt) > MAX_BATCH_PROMPTS:
                    raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request")
                return prompt
            raise ValueError("must be a string, a list of token ids, or a list of those")
        return prompt

    @field_validator("echo")
    @classmethod
    def _refuse_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _refuse_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return suffix

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        return [self.prompt] if _is_prompt(self.prompt) else list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    # OpenAI's rule for names; it also keeps template syntax and special tokens out of them
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")

    @property
    def num_chars(self) -> int:
        """Characters of content (text parts and the newlines that join them)."""
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(part.text) + 1 for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the tokenizer's chat template takes it (`developer` is a system
        message; the tokenizer flattens text parts, the same way for every caller)."""
        content: Any = self.content
        if not isinstance(content, str):
            content = [part.model_dump() for part in content]
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ResponseFormat(_Strict):
    type: Literal["text"]  # structured output (json_object, json_schema) is not supported


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the model's chat template renders the messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # declared to be refused when non-empty
    tool_choice: Any = None  # declared to be refused unless "none"

    @field_validator("tools")
    @classmethod
    def _refuse_tools(cls, tools: list[Any] | None) -> list[Any] | None:
        if tools:
            raise ValueError("tools are not supported")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _refuse_tool_choice(cls, choice: Any) -> Any:
        if choice not in (None, "none"):
            raise ValueError('tool_choice is not supported (only "none")')
        return choice

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
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


def _is_prompt(prompt: Any) -> bool:
    """A single prompt: a string, or a list of token ids (ints, not bools)."""
    if isinstance(prompt, str):
        return True
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
