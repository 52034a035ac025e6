"""Responses API items <-> the Chat Completions shapes the rest of the server speaks.

In:  `input` (a string, or a list of items) and `instructions` become chat messages:

    {"role": r, "content": str | [input_text/output_text parts]}   a message (type "message"
                                                                   optional, id/status ignored)
    {"type": "function_call", call_id, name, arguments}             an assistant tool call; calls
                                                                   right after an assistant
                                                                   message (or each other) join it
    {"type": "function_call_output", call_id, output}               a tool message
    instructions                                                    a system message, first

and `tools` / `tool_choice` become Chat Completions' tools and tool_choice. Whatever this server
cannot take (reasoning items, images, files, built-in tools) is an `ItemError` naming the field.
Joining calls to the message before them makes an output the model wrote as one turn (text,
then calls) come back as one assistant message: the turn memo finds its generated ids again.

Out: one finished output (content, calls) becomes output items, a message then function calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from radixlm.agents.tool_parser import ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")


class ItemError(ValueError):
    """An input the Responses API defines that this server cannot take; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(items: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of `input` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(where, item))
        elif kind == "function_call":
            call = _function_call(where, item)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_output(where, item))
        elif kind == "reasoning":
            raise ItemError(f"{where}.type", f"{where}: reasoning items are not supported")
        else:
            raise ItemError(f"{where}.type", f"{where}.type {kind!r} is not supported")
    return out


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions' shape; `strict` defaults to true, as the Responses
    API has it. Any other type of tool is an ItemError."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ItemError(
                f"tools[{i}].type",
                f"tools[{i}].type {kind!r} is not supported: this server runs function tools only",
            )
        known = {"type", "name", "description", "parameters", "strict"}
        extra = sorted(set(tool) - known)
        if extra:
            raise ItemError(f"tools[{i}].{extra[0]}", f"tools[{i}].{extra[0]} is not supported")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        function["strict"] = tool.get("strict", True) is not False
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | Mapping[str, Any] | None) -> object:
    """tool_choice in Chat Completions' shape (the strings pass through)."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": choice.get("mode"), "tools": choice.get("tools")}}  # fmt: skip
    raise ItemError("tool_choice", f"tool_choice of type {kind!r} is not supported")


def output_items(content: str | None, calls: Sequence[ToolCall], complete: bool) -> list[Any]:
    """An output as items: its text as one message (when it has text), then each call."""
    items: list[dict[str, Any]] = []
    if content:
        items.append(message_item(new_id("msg"), content, complete))
    items += [function_call_item(call) for call in calls]
    return items


def message_item(item_id: str, text: str, complete: bool) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": "completed" if complete else "incomplete",
        "role": "assistant",
        "content": [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "status": "completed",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def response_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's function tools, as the response object echoes them."""
    return [{"type": "function", "description": None, **t["function"]} for t in tools or ()]


# ---- helpers --------------------------------------------------------------------------------
def _message(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ItemError(
            f"{where}.role", f"{where}.role must be user, system, developer or assistant"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ItemError(f"{where}.content", f"{where}.content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "refusal" and role == "assistant":
            texts.append(str(part.get("refusal", "")))
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            param = f"{where}.content[{j}].type"
            raise ItemError(param, f"{param} {kind!r} is not supported: text parts only")
    return {"role": role, "content": "\n".join(texts)}


def _function_call(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise ItemError(f"{where}.{field}", f"{where}.{field} must be a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_output(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise ItemError(f"{where}.call_id", f"{where}.call_id must be a string")
    if isinstance(output, list):  # a list of input_text parts
        texts = [p.get("text") for p in output if isinstance(p, Mapping)]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            raise ItemError(f"{where}.output", f"{where}.output must be text")
        output = "\n".join(texts)  # type: ignore[arg-type]
    if not isinstance(output, str):
        raise ItemError(f"{where}.output", f"{where}.output must be a string")
    return {"role": "tool", "tool_call_id": call_id, "content": output}
