"""Helpers for the agent tests: a grammar-driven "model" that picks random allowed tokens.

Random choices among the tokens a grammar allows produce unusual tokenizations (a JSON key spelled
as several short tokens where the tokenizer would use one), which is exactly what re-rendering a
turn must survive.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from radixlm.agents.grammar import GrammarMatcher, apply_token_masks

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


def random_constrained(
    matcher: GrammarMatcher, vocab_size: int, eos: frozenset[int], seed: int, limit: int = 400
) -> list[int]:
    """Sample uniformly among allowed tokens until an end-of-sequence token (kept, last)."""
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(limit):
        masked = apply_token_masks(torch.zeros(1, vocab_size), [matcher]).scores[0]
        allowed = torch.isfinite(masked).nonzero().flatten().tolist()
        ends = [t for t in allowed if t in eos]
        stop = ends and (len(ends) == len(allowed) or rng.random() < 0.8)
        token = ends[0] if stop else rng.choice([t for t in allowed if t not in eos])
        out.append(token)
        if token in eos:
            return out
        matcher.advance(token)
    raise AssertionError("the grammar did not finish within the limit")
