"""OpenAI's response shapes, built from engine deltas: whole responses, stream chunks, logprobs.

Completions and chat differ only in how a choice carries its text (`text` against `message` /
`delta`) and how logprobs are laid out:

    completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{...}, ...]}]}

`usage.prompt_tokens_details.cached_tokens` is on every usage object, as OpenAI reports it, unless
the server is set to hide it (`--report-cached-tokens none`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from radixlm.api_types import TokenLogprob
from radixlm.server.generation import ChoiceDelta, Usage

Kind = Literal["completion", "chat"]
TokenText = Callable[[int], str]  # one token's text, special tokens included


@dataclass
class ChoiceResult:
    """One choice of a non-streaming response, accumulated from its deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    # chat with tools: the content left around the calls, and the calls (whole messages) or
    # the call deltas (stream chunks); None when no call was made
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, choice: ChoiceDelta) -> ChoiceResult:
        """One delta on its own (a stream chunk)."""
        result = cls(choice.index)
        result.add(choice)
        return result

    def add(self, choice: ChoiceDelta) -> None:
        d = choice.delta
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.error = d.error


@dataclass(frozen=True)
class ResponseHeader:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    kind: Kind
    top_logprobs: int | None  # None: the request did not ask for logprobs
    token_text: TokenText
    n: int = 1  # samples per prompt: choice i belongs to prompt i // n
    prompts: tuple[tuple[int, ...], ...] | None = None  # set when token ids are returned

    def base(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def full_response(
    header: ResponseHeader, choices: Sequence[ChoiceResult], usage: Usage
) -> dict[str, Any]:
    out = header.base(chunk=False)
    out["choices"] = [
        _choice(header, c, "".join(c.text), offset=0, chunk=False, first=True)
        for c in sorted(choices, key=lambda c: c.index)
    ]
    out["usage"] = usage.to_dict()
    return out


def stream_chunk(
    header: ResponseHeader,
    delta: ChoiceResult,
    text_offset: int = 0,
    first: bool = False,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One choice's increment (`delta` holds what arrived since the last chunk). `first` adds
    the chat role (and the prompt's token ids); `include_usage` a null usage."""
    out = header.base(chunk=True)
    text = "".join(delta.text)
    choice = _choice(header, delta, text, text_offset, chunk=True, first=first)
    if first and header.kind == "chat":
        choice["delta"] = {"role": "assistant", **choice["delta"]}
    out["choices"] = [choice]
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(header: ResponseHeader, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    out = header.base(chunk=True)
    out["choices"] = []
    out["usage"] = usage.to_dict()
    return out


def public_finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop", "length" and "tool_calls"; an aborted or failed sample is reported
    as an error."""
    return reason if reason in ("stop", "length", "tool_calls", None) else None


# ---- helpers --------------------------------------------------------------------------------
def _choice(
    header: ResponseHeader, c: ChoiceResult, text: str, offset: int, chunk: bool, first: bool
) -> dict[str, Any]:
    lp: dict[str, Any] | None = None
    if header.top_logprobs is not None:
        k, token_text = header.top_logprobs, header.token_text
        if header.kind == "chat":
            lp = _chat_logprobs(c.logprobs, k, token_text)
        else:
            lp = _completion_logprobs(c.logprobs, k, token_text, offset)
    out: dict[str, Any] = {"index": c.index}
    if header.kind == "completion":
        out["text"] = text
    elif chunk:
        plain = c.finish_reason is None and not c.tool_calls
        out["delta"] = {"content": text} if text or plain else {}
        if c.tool_calls:
            out["delta"]["tool_calls"] = c.tool_calls
    elif c.tool_calls:
        out["message"] = {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
    else:
        out["message"] = {"role": "assistant", "content": text}
    out["logprobs"] = lp
    out["finish_reason"] = public_finish_reason(c.finish_reason)
    if header.prompts is not None:
        out["token_ids"] = list(c.token_ids)
        if first:
            out["prompt_token_ids"] = list(header.prompts[c.index // header.n])
    return out


def _completion_logprobs(
    logprobs: list[TokenLogprob], k: int, token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top[:k]} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(logprobs: list[TokenLogprob], k: int, token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:k]]}
            for lp in logprobs
        ]
    }
