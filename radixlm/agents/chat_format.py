"""OpenAI tool conversations as chat-template messages.

A conversation may hold assistant messages with `tool_calls` (and `content: null`) and `tool`
messages answering them. When the model's chat template renders `tools` itself (Qwen, Llama 3.1,
Hermes), messages go to it in Hugging Face's tool-use convention. Otherwise (SmolLM2's template
ignores tools) a built-in Hermes/Qwen-style format turns everything into plain messages:

    system     <its content>\n\n# Tools ... <tools>\n{tool}\n{tool}\n</tools> ...
    assistant  <content>\n<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
    user       <tool_response>\n<result>\n</tool_response>   (consecutive tool messages merged)

Both paths render tools sorted by name with canonical JSON, so the prompt's bytes do not depend
on the order a client lists them in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixlm.agents.tools import NAME, ToolSpec, canonical_json

ROLES = ("system", "developer", "user", "assistant", "tool")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_PROBE_TOOL = "radixlm_probe_tool"


def call_prefix(name: str) -> str:
    """The text of a built-in tool call up to its arguments (the grammar forces the same)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


CALL_SUFFIX = f"}}\n{CALL_CLOSE}"
CALL_SEPARATOR = "\n"  # between parallel calls


def format_tool_call(name: str, arguments: str) -> str:
    """One call as the built-in format writes it; `arguments` (a JSON text) goes in verbatim."""
    return call_prefix(name) + (arguments.strip() or "{}") + CALL_SUFFIX


def template_renders_tools(hf_tokenizer: Any) -> bool:
    """Whether the chat template writes the `tools` it is given (probed once per tokenizer)."""
    if getattr(hf_tokenizer, "chat_template", None) is None:
        return False
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
    try:
        text = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[tool], tokenize=False
        )
    except Exception:  # a template may reject the probe; then it does not do tools our way
        return False
    return _PROBE_TOOL in str(text)


def check_messages(messages: object) -> list[dict[str, Any]]:
    """Validate an OpenAI conversation, the one check every way to a prompt runs: every content
    flattened to a string (None only for an assistant message with tool calls), each tool call
    as {"id", "name", "arguments"}; `developer` is a system message; `name` kept when valid.

    Raises ValueError naming the message and field: not a list, an unknown role, a missing
    content, a bad name, a tool message whose tool_call_id no earlier assistant call has, a
    malformed tool call.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    checked = [_check_message(i, m) for i, m in enumerate(messages)]
    if not checked:
        raise ValueError("messages must not be empty")
    _check_tool_call_ids(checked)
    return checked


def to_template_messages(
    checked: Sequence[dict[str, Any]], tools: Sequence[ToolSpec], native: bool
) -> list[dict[str, Any]]:
    """The messages a chat template takes, from `check_messages`' output. Assistant messages
    map one to one and in order (tool messages may merge, a system message may be added)."""
    if native:
        return [_native_message(m) for m in checked]
    return _builtin_messages(list(checked), tools)


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tools for a template that renders them: canonical key order (templates dump dicts in
    insertion order), sorted by name."""
    return [json.loads(canonical_json(t.to_openai())) for t in tools]


def tools_system_block(tools: Sequence[ToolSpec]) -> str:
    lines = "\n".join(canonical_json(t.to_openai()) for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


# ---- helpers --------------------------------------------------------------------------------
def _check_message(i: int, message: object) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and not calls:
        raise ValueError(f"{where}.content is missing")
    out["content"] = None if content is None else flatten_content(where, content)
    if calls:
        out["tool_calls"] = [
            _check_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls)
        ]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{where}.tool_call_id is missing")
        out["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
        out["name"] = name
    return out


def flatten_content(where: str, content: object) -> str:
    """A message's content as one string: a string as it is, a list of text parts joined by
    newlines; anything else is a ValueError naming `where`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', ...}}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _check_call(where: str, call: object) -> dict[str, str]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or not isinstance(function, Mapping):
        raise ValueError(f"{where} must be {{'id', 'type': 'function', 'function': {{...}}}}")
    name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(f"{where}.function needs a string name and string arguments")
    return {"id": call_id if isinstance(call_id, str) else "", "name": name, "arguments": arguments}


def _check_tool_call_ids(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call an earlier assistant message made (by its id)."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        seen.update(c["id"] for c in m.get("tool_calls", ()) if c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in seen:
            raise ValueError(
                f"messages[{i}].tool_call_id {m['tool_call_id']!r} matches no tool call of an "
                "earlier assistant message"
            )


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {**m, "content": m["content"] or ""}
    if "tool_calls" in m:  # Hugging Face's convention: arguments as an object when it is one
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": _json_or_text(c["arguments"])}}
            for c in m["tool_calls"]
        ]  # fmt: skip
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _builtin_messages(
    messages: list[dict[str, Any]], tools: Sequence[ToolSpec]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = CALL_SEPARATOR.join(
                format_tool_call(c["name"], c["arguments"]) for c in m["tool_calls"]
            )
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    for m in out:
        m.pop("tool_responses", None)
    if tools:
        block = tools_system_block(tools)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
