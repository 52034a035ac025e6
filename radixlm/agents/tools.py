"""Tool definitions and tool_choice, validated once, and their canonical JSON.

Two clients that send the same tools in a different order, or with keys in another order, must
render the same prompt bytes, or the prefix cache diverges at the first tool. So tools are sorted
by name and serialized with sorted keys and fixed separators (`canonical_json`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# OpenAI's rule for function and message names, always matched whole (`fullmatch`: "$" would
# let a trailing newline through); it also keeps names safe inside the grammar's literals.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

ChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    """One function tool. `parameters` is a JSON Schema for the arguments object."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]
    strict: bool = False

    def to_openai(self) -> dict[str, Any]:
        """The tool as OpenAI defines it, with no field the client left out."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        if self.strict:
            function["strict"] = True
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """What the model may or must do with the tools: none, auto, required or one named tool.

    `allowed` (OpenAI's `allowed_tools`) narrows which tools auto or required may call, while
    every tool stays in the prompt: the prompt, and so its cached prefix, does not change when
    a loop narrows its choice from one step to the next.
    """

    mode: ChoiceMode
    name: str | None = None  # the tool a "named" choice forces
    allowed: tuple[str, ...] | None = None  # sorted; None: every tool

    def callable(self, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
        """The tools a call may name under this choice."""
        if self.mode == "named":
            return [t for t in tools if t.name == self.name]
        if self.allowed is not None:
            return [t for t in tools if t.name in self.allowed]
        return list(tools)


def canonical_json(value: object) -> str:
    """JSON with sorted keys and fixed separators: equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)


def parse_tools(raw: object) -> list[ToolSpec]:
    """Validate OpenAI `tools` and return them sorted by name. Raises ValueError naming the
    first bad tool and field (a name used twice, a non-object schema, ...)."""
    if raw is None:
        return []
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    tools: dict[str, ToolSpec] = {}
    for i, entry in enumerate(raw):
        tool = _parse_tool(f"tools[{i}]", entry)
        if tool.name in tools:
            raise ValueError(f"tools[{i}].function.name {tool.name!r} is used by two tools")
        tools[tool.name] = tool
    return [tools[name] for name in sorted(tools)]


def parse_tool_choice(raw: object, tools: Sequence[ToolSpec]) -> ToolChoice:
    """Validate `tool_choice` against the tools. Without tools only "none" (or nothing) fits;
    the default is "auto" with tools and "none" without, as OpenAI has it. Chat Completions'
    shapes: {"type": "function", "function": {"name"}} and {"type": "allowed_tools",
    "allowed_tools": {"mode", "tools": [{"type": "function", "function": {"name"}}]}}."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise ValueError(f'tool_choice "{raw}" needs tools')
        return ToolChoice(raw)
    names = {t.name for t in tools}
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        name = _function_name(raw.get("function"), "tool_choice.function")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return ToolChoice("named", name)
    if isinstance(raw, Mapping) and raw.get("type") == "allowed_tools":
        allowed = raw.get("allowed_tools")
        if not isinstance(allowed, Mapping):
            raise ValueError("tool_choice.allowed_tools must be an object with mode and tools")
        return allowed_tools(allowed.get("mode"), allowed.get("tools"), names)
    raise ValueError(
        'tool_choice must be "none", "auto", "required", '
        '{"type": "function", "function": {"name": ...}} or '
        '{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}'
    )


def allowed_tools(mode: object, entries: object, names: set[str]) -> ToolChoice:
    """An allowed_tools choice: "auto" or "required" among the tools listed (each a function
    tool given by name, as {"type": "function", "name"} or {"type": "function", "function":
    {"name"}})."""
    where = "tool_choice.allowed_tools"
    if mode not in ("auto", "required"):
        raise ValueError(f'{where}.mode must be "auto" or "required"')
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ValueError(f"{where}.tools must be a non-empty list of function tools")
    allowed = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or entry.get("type") != "function":
            raise ValueError(f"{where}.tools[{i}] must be a function tool")
        name = entry.get("name") if "name" in entry else None
        name = name or _function_name(entry.get("function"), f"{where}.tools[{i}].function")
        if name not in names:
            raise ValueError(f"{where}.tools[{i}] names {name!r}, which is not in tools")
        allowed.add(name)
    return ToolChoice(mode, allowed=tuple(sorted(allowed)))


# ---- helpers --------------------------------------------------------------------------------
def _function_name(function: object, where: str) -> str:
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f"{where}.name must be a string")
    return name


def _parse_tool(where: str, entry: object) -> ToolSpec:
    if not isinstance(entry, Mapping) or entry.get("type") != "function":
        raise ValueError(f"{where} must be an object with type 'function'")
    function = entry.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON Schema object")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"{where}.function.parameters must describe an object (type 'object')")
    strict = function.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise ValueError(f"{where}.function.strict must be a boolean")
    return ToolSpec(name, description, parameters, bool(strict))
