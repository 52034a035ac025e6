"""JSON Schemas as the grammar takes them: tool arguments closed the way OpenAI's strict mode
closes them, and references that can never produce a value refused before compiling.

- `closed_schema`: every object schema that declares its properties and does not say otherwise
  gets `additionalProperties: false`. A non-strict schema (LangChain's `bind_tools`, raw dict
  tools, instructor's TOOLS and JSON_SCHEMA modes) usually leaves it out, and JSON Schema then
  allows any other key: a small model invents properties until max_tokens. Closed, the grammar
  writes only the declared properties, each at most once, in the order declared. Tool arguments
  and response formats are closed alike.
- `check_ref_loops`: a `$ref` whose chain of references comes back to itself before any
  schema without a `$ref` (`{"$defs": {"x": {"$ref": "#/$defs/x"}}}`) matches nothing; the grammar
  would allow no token at the point it is needed, a failure in the middle of an answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Keywords whose value is a schema, a list of schemas or a map of name -> schema.
_ONE = (
    *("additionalProperties", "items", "contains", "not", "if", "then", "else"),
    *("propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems"),
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
MAX_REF_HOPS = 256  # a longer chain of pure references is refused as if it looped


def closed_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `schema` in which every object schema that declares `properties` but not
    `additionalProperties` (nor `patternProperties`, which already says which other keys are
    allowed) has it false. An object schema without properties (`{"type": "object"}`: any
    object) stays open."""
    out = {key: _close_value(key, value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_ref_loops(schema: Mapping[str, Any], name: str) -> None:
    """ValueError naming the first `$ref` of `schema` whose references lead back to itself
    before reaching a schema without a $ref. Local references ("#/...") only; any other is left to
    the grammar library."""
    resolved: set[str] = set()  # references known to end in a real schema
    for node in _subschemas(schema):
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#") or ref in resolved:
            continue
        chain = [ref]
        target = _resolve(schema, ref)
        while isinstance(target, Mapping) and isinstance(target.get("$ref"), str):
            # a $ref with other keywords beside it must match both: siblings do not end a loop
            next_ref = target["$ref"]
            if next_ref in chain or len(chain) > MAX_REF_HOPS:
                raise ValueError(f"{name}: the $ref {ref!r} loops on itself, so no value matches")
            if next_ref in resolved or not next_ref.startswith("#"):
                break
            chain.append(next_ref)
            target = _resolve(schema, next_ref)
        resolved.update(chain)


# ---- helpers --------------------------------------------------------------------------------
def _close_value(key: str, value: Any) -> Any:
    if key in _ONE and isinstance(value, Mapping):
        return closed_schema(value)
    if key in _MANY and isinstance(value, list):
        return [closed_schema(v) if isinstance(v, Mapping) else v for v in value]
    if key in _MAP and isinstance(value, Mapping):
        return {k: closed_schema(v) if isinstance(v, Mapping) else v for k, v in value.items()}
    return value


def _subschemas(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every schema inside `schema` (itself included), without recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        yield node
        for key, value in node.items():
            if key in _ONE and isinstance(value, Mapping):
                stack.append(value)
            elif key in _MANY and isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, Mapping))
            elif key in _MAP and isinstance(value, Mapping):
                stack.extend(v for v in value.values() if isinstance(v, Mapping))


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The value a local JSON pointer names, or None when it names nothing."""
    node: Any = root
    for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
