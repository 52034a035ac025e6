"""Request traces for the cache benchmarks: reading JSONL files into token-id arrays.

Two line forms are accepted:
- `{"prompt": [ids], "output": [ids]}` (output optional) — explicit token ids;
- the Mooncake form `{"hash_ids": [...], "input_length": n, "output_length": m}`: hash id `h`
  stands for the 512 distinct tokens `h*512 + i`, the prompt is cut to `input_length`, and the
  output gets fresh ids that no other request uses (so only prompts can be shared).
A malformed line raises TraceError naming the file, the line number and the problem.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
_FRESH_BASE = 1 << 40  # output ids of Mooncake requests start here, above every block token


class TraceError(ValueError):
    """A trace file that cannot be read; the message says where and why."""


class TraceRequest(NamedTuple):
    full: np.ndarray  # prompt + output token ids, int64; what is inserted when it finishes
    prompt_len: int

    @property
    def prompt(self) -> np.ndarray:
        return self.full[: self.prompt_len]


def load_trace(path: str, block: int = MOONCAKE_BLOCK) -> list[TraceRequest]:
    """Read a JSONL trace (see the module docstring). Blank lines are skipped."""
    requests: list[TraceRequest] = []
    fresh = _FRESH_BASE
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request, num_fresh = _parse(line, block, fresh)
            except TraceError as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
            fresh += num_fresh
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def _parse(line: str, block: int, fresh: int) -> tuple[TraceRequest, int]:
    """One line -> its request and how many fresh output ids (from `fresh` on) it took."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        prompt = _ids(record, "prompt")
        output = _ids(record, "output") if "output" in record else np.empty(0, np.int64)
        return TraceRequest(np.concatenate([prompt, output]), len(prompt)), 0
    if "hash_ids" in record:
        hash_ids = _ids(record, "hash_ids")
        input_len = _count(record, "input_length")
        output_len = _count(record, "output_length") if "output_length" in record else 0
        if input_len > len(hash_ids) * block:
            raise TraceError(
                f"input_length {input_len} exceeds {len(hash_ids)} hash ids x {block} tokens"
            )
        tokens = (hash_ids[:, None] * block + np.arange(block, dtype=np.int64)).ravel()
        output = np.arange(fresh, fresh + output_len, dtype=np.int64)
        return TraceRequest(np.concatenate([tokens[:input_len], output]), input_len), output_len
    raise TraceError("need a 'prompt' list or Mooncake 'hash_ids'")


def _ids(record: dict[str, Any], field: str) -> np.ndarray:
    value = record[field]
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise TraceError(f"'{field}' must be a list of integers")
    try:
        ids = np.asarray(value, dtype=np.int64) if value else np.empty(0, np.int64)
    except OverflowError:
        raise TraceError(f"'{field}' has a token id beyond int64") from None
    if ids.size and ids.min() < 0:
        raise TraceError(f"'{field}' has a negative token id")
    return ids


def _count(record: dict[str, Any], field: str) -> int:
    value = record[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"'{field}' must be a non-negative integer, got {value!r}")
    return value
