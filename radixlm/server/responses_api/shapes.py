"""The Responses API's answers: the response object, its usage, and the events of a stream.

    response.created, response.in_progress
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Each event carries `type` and a `sequence_number` from 0, written as `event: TYPE` and `data:`.
A call arrives whole (the tool parser sends it once closed), so its arguments are one delta.
Usage is OpenAI's: input/output tokens, `input_tokens_details.cached_tokens` (and the tokens
written to the cache, the rest of the input), unless the server hides cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.agents.tool_parser import ToolCall
from radixlm.server.generation import Usage
from radixlm.server.respond import compact_json
from radixlm.server.responses_api.items import (
    function_call_item,
    message_item,
    new_id,
    output_items,
    text_part,
)
from radixlm.server.responses_api.protocol import ResponsesRequest


@dataclass(frozen=True)
class ResponseHeader:
    """What the response object repeats from its request."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest
    tools: list[dict[str, Any]]  # the function tools, echoed

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None = None,
        error: str | None = None,
    ) -> dict[str, Any]:
        """The response object; `status` is in_progress, completed, incomplete or failed."""
        body = self.request
        fmt = body.text.format if body.text is not None and body.text.format else None
        text: dict[str, Any] = {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
            "verbosity": (body.text.verbosity if body.text else None) or "medium",
        }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": body.safety_identifier,
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": self.tools,
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else usage_object(usage),
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def whole(self, content: str | None, calls: list[ToolCall], cut: bool, usage: Usage) -> Any:
        """The response of a finished output, not streamed."""
        output = output_items(content, calls, complete=not cut)
        return self.response("incomplete" if cut else "completed", output, usage)


def usage_object(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens is not None:  # the server may hide it (--report-cached-tokens none)
        written = usage.prompt_tokens - usage.cached_tokens
        out["input_tokens_details"] = {"cached_tokens": usage.cached_tokens,
                                       "cache_write_tokens": written}  # fmt: skip
    return out


@dataclass
class ResponseEvents:
    """The events of one streamed response, in order (see the module docstring)."""

    header: ResponseHeader
    output: list[dict[str, Any]] = field(default_factory=list)  # the items done so far
    _sequence: int = 0
    _message: dict[str, Any] | None = None  # the message item being written
    _text: list[str] = field(default_factory=list)

    def start(self) -> list[str]:
        created = self.header.response("in_progress", [])
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]  # fmt: skip

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self._message is None:
            self._message = {**message_item(new_id("msg"), "", True), "status": "in_progress"}
            self._message["content"] = []
            out.append(self._event("response.output_item.added", output_index=len(self.output),
                                   item=self._message))  # fmt: skip
            out.append(self._event("response.content_part.added", **self._part_at(),
                                   part=text_part("")))  # fmt: skip
        self._text.append(delta)
        out.append(self._event("response.output_text.delta", **self._part_at(), delta=delta,
                               logprobs=[]))  # fmt: skip
        return out

    def call(self, call: ToolCall) -> list[str]:
        out = self._close_message(complete=True)
        item = function_call_item(call)
        at = {"output_index": len(self.output), "item_id": item["id"]}
        out += [
            self._event("response.output_item.added", output_index=at["output_index"],
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", **at, delta=call.arguments),
            self._event("response.function_call_arguments.done", **at, name=call.name,
                        arguments=call.arguments),
            self._event("response.output_item.done", output_index=at["output_index"], item=item),
        ]  # fmt: skip
        self.output.append(item)
        return out

    def finish(self, cut: bool, usage: Usage) -> tuple[list[str], dict[str, Any]]:
        """The closing events and the final response object."""
        out = self._close_message(complete=not cut)
        status = "incomplete" if cut else "completed"
        final = self.header.response(status, self.output, usage)
        out.append(self._event(f"response.{status}", response=final))
        return out, final

    def failed(self, message: str) -> list[str]:
        failed = self.header.response("failed", self.output, error=message)
        return [self._event("response.failed", response=failed)]

    # ---- helpers ----------------------------------------------------------------------------
    def _close_message(self, complete: bool) -> list[str]:
        if self._message is None:
            return []
        text = "".join(self._text)
        item = message_item(self._message["id"], text, complete)
        at = self._part_at()
        out = [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=text_part(text)),
            self._event("response.output_item.done", output_index=at["output_index"], item=item),
        ]
        self.output.append(item)
        self._message, self._text = None, []
        return out

    def _part_at(self) -> dict[str, Any]:
        assert self._message is not None
        return {"item_id": self._message["id"], "output_index": len(self.output),
                "content_index": 0}  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {compact_json(data)}\n\n"
