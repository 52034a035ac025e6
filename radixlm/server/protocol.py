"""The request schemas of the OpenAI-compatible routes, strict by construction.

Every model forbids unknown fields (an unknown parameter is a 400 naming it) and validates in
pydantic's strict mode (a string is never coerced into a number). Parameters OpenAI defines that
radixlm does not implement are declared, so a request using them gets "not supported" rather than
"unrecognized", and rejected unless they hold their no-op value. Extensions follow vLLM's names
(`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `cache_salt`,
`return_token_ids`, `min_tokens`). OpenAI's bookkeeping fields (`store`, `metadata`,
`prompt_cache_key`, `user`) are accepted and change nothing; its `prompt_cache_retention` tells
the disk tier what to keep (docs/cache.md).

The chat request and its tools live in `chat_protocol.py`; this file holds the shared fields, the
completion request and the message schema. What these models guarantee is shape and range; what
depends on the loaded model (context length, vocabulary, pool size) is checked by the route
against the model's limits.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16  # samples per prompt; each one holds its own KV slots while decoding
MAX_STOP = 16  # stop strings per request
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value; larger ones are clamped


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
    store: bool | None = None  # OpenAI's stored completions: accepted, nothing is stored
    metadata: dict[str, str] | None = None  # for the caller's records; changes nothing
    prompt_cache_key: str | None = None  # OpenAI's cache routing hint; the radix tree needs none
    # "24h": write this request's KV to the disk tier at finish; "in_memory": never to disk
    # ("in-memory": the spelling of OpenAI's first SDKs)
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    min_tokens: int = Field(0, ge=0)  # end-of-sequence and stop ids are banned until then (vLLM)
    return_token_ids: bool = False  # choices carry their token ids (vLLM's extension)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias, clamped to +-100

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
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(bias)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return logit_bias_pairs(self.logit_bias)

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def cache_retention(self) -> Literal["in_memory", "24h"] | None:
        value = self.prompt_cache_retention
        return "in_memory" if value == "in-memory" else value

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
    return_cache_report: bool = False  # why the cache missed, per prompt: docs/observatory.md

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
    def is_batch(self) -> bool:
        """The prompt is a list of prompts (even a list of one)."""
        return not _is_prompt(self.prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        return list(self.prompt) if self.is_batch else [self.prompt]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's tool calls
    # OpenAI's rule for names; it also keeps template syntax and special tokens out of them
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call this answers
    # What OpenAI's client sends back with an assistant message it received: accepted, unused
    # (`parsed` is what the SDK's parse() adds to a message: the content, as an object)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    parsed: Any = None

    def check(self, where: str) -> None:
        """What a message's role demands of its fields (ParamError naming the field)."""
        if self.tool_calls and self.role != "assistant":
            raise ParamError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ParamError(f"{where}.content", f"Missing required parameter: {where}.content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ParamError(
                f"{where}.tool_call_id", "tool messages, and only they, carry a tool_call_id"
            )

    @property
    def num_chars(self) -> int:
        """Characters of content (text parts and the newlines that join them) and of calls."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        if self.content is None or isinstance(self.content, str):
            return len(self.content or "") + calls
        return sum(len(part.text) + 1 for part in self.content) + calls

    def to_template(self) -> dict[str, Any]:
        """The message as radixlm's chat rendering takes it (OpenAI's shape; `developer` is a
        system message; text parts are flattened there, the same way for every caller)."""
        content: Any = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def check_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """A logit_bias whose keys are token ids (ValueError otherwise)."""
    for key in bias or {}:
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids; got {key!r}")
    return bias


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """(token id, bias) with each bias clamped to OpenAI's [-100, 100]; ids are checked
    against the vocabulary by the route."""
    clamp = MAX_LOGIT_BIAS
    return tuple((int(k), min(max(v, -clamp), clamp)) for k, v in sorted((bias or {}).items()))


def _is_prompt(prompt: Any) -> bool:
    """A single prompt: a string, or a list of token ids (ints, not bools)."""
    if isinstance(prompt, str):
        return True
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
