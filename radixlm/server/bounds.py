"""Bounded work before the engine sees a request: length checks first, then tokenization.

A request may cost the server only what its answer is worth, so the cheap checks run first:

1. The number of JSON values, before the schema: the schema holds the GIL for every value it
   reads (~10 us for a chat message), so a 25 MiB body of one-character messages or of token ids
   stalled every stream for seconds. A request can only use so many values: 64 prompts of at
   most max_seq_len ids, or max_seq_len messages (each takes at least one token) of a few values
   each. `json_values_bound` counts them with vectorized byte scans (numpy, the GIL released) on
   the tokenizer threads, and only when a plain comma count says the body might exceed its bound.
2. Lengths in characters. No token of the model covers more than `max_chars_per_token`
   characters, so a text longer than `max_seq_len * max_chars_per_token` cannot fit, and is a 400
   before a single token is computed (a 30 MB prompt used to cost ~44 s and GBs to refuse). Chat
   counts the characters of all contents together, and the messages (every template writes at
   least one token per message, its role marker). Every other field a client fills is counted
   in the same bound before anything reads it (`check_fields`): the tools (names, descriptions,
   schemas: rendered into the prompt), the response format's schema (compiled to a grammar),
   the stop strings (matched against an output that must fit too) and the logit_bias entries;
   chat adds them to its contents (a 20 MB tool description used to take 20 s of CPU before
   its 400).
3. Token arrays: their length against `max_seq_len`, before each id is checked.
4. Tokenization and chat-template rendering run in a small thread pool, off the event loop, at
   most `max_concurrent_tokenizations` at once; up to `max_queued_tokenizations` more wait, and
   beyond that a request is a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from radixlm.config import ServerConfig
from radixlm.server.errors import APIError
from radixlm.server.protocol import MAX_BATCH_PROMPTS, ChatMessage

T = TypeVar("T")
# The fields check_fields counts, by their names on the request models (absent ones count 0).
FIELDS = ("input", "instructions", "tools", "response_format", "text", "logit_bias")


@dataclass(frozen=True)
class ModelLimits:
    """What bounds one sequence on this server, read once from the engine."""

    max_context_len: int  # prompt + output tokens of one sequence
    num_slots: int  # KV slots in the pool: one sequence can never hold more
    vocab_size: int

    @property
    def max_seq_len(self) -> int:
        return min(self.max_context_len, self.num_slots)

    def describe(self) -> str:
        """Which limit bounds one sequence, in words: the model's context, or the KV pool when
        the server was given fewer slots than that."""
        if self.num_slots < self.max_context_len:
            return (
                f"this server's KV pool holds {self.num_slots} tokens, the most one sequence can "
                f"use (prompt and completion together; the model's context length is "
                f"{self.max_context_len})"
            )
        return (
            f"the model's context length is {self.max_context_len} tokens "
            "(prompt and completion together)"
        )


class RequestBounds:
    """Turns prompts into token ids within bounds (see the module docstring)."""

    def __init__(self, tokenizer: Any, limits: ModelLimits, config: ServerConfig) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_chars_per_token = int(tokenizer.max_chars_per_token)
        self.max_prompt_chars = limits.max_seq_len * self.max_chars_per_token
        self.retry_after_s = config.retry_after_s
        self._max_pending = config.max_concurrent_tokenizations + config.max_queued_tokenizations
        self._pending = 0  # submitted and not yet finished (running or queued), under _lock
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            config.max_concurrent_tokenizations, thread_name_prefix="radixlm-tokenize"
        )

    async def check_json_values(self, raw: bytes, chat: bool) -> None:
        """A 400 when a body holds more JSON values than any request that fits could use."""
        seq_len = self.limits.max_seq_len
        limit = 8 * seq_len + 256 if chat else MAX_BATCH_PROMPTS * (seq_len + 1) + 256
        quick = raw.count(b",") + raw.count(b"[") + raw.count(b"{")  # counts commas in text too
        if quick < limit or await self._run(json_values_bound, raw) <= limit:
            return
        what = "messages" if chat else "prompt"
        raise APIError(
            400,
            f"The request holds more than {limit} JSON values and cannot fit: "
            f"{self.limits.describe()}",
            param=what,
            code="context_length_exceeded",
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_fields(self, body: Any, messages: Sequence[ChatMessage] = ()) -> None:
        """A 400 when the characters of every client-filled field but the completion prompt
        cannot fit: the messages, and those of FIELDS the body has (a Responses request's input
        and instructions among them). Run it before any of them is parsed further, compiled or
        rendered. O(JSON values) of those fields."""
        sizes = {"messages": sum(message.num_chars for message in messages)}
        sizes.update({name: json_chars(getattr(body, name, None)) for name in FIELDS})
        sizes["stop"] = sum(len(s) for s in getattr(body, "stop_list", ()))
        total = sum(sizes.values())
        if total <= self.max_prompt_chars:
            return
        parts = ", ".join(f"{name} {n}" for name, n in sizes.items() if n)
        raise APIError(
            400,
            f"The request's fields hold {total} characters ({parts}) and cannot fit: no token of "
            f"this model covers more than {self.max_chars_per_token} characters, and "
            f"{self.limits.describe()}",
            param=max(sizes, key=lambda name: sizes[name]),
            code="context_length_exceeded",
        )

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of one completions prompt (text or ids), or a 400 saying why not."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt", "The prompt")
            ids = await self._run(self.tokenizer.encode, prompt) if prompt else []
        else:
            ids = prompt
        if not ids:
            raise APIError(400, "The prompt is empty", param="prompt")
        check_fits(self.limits, len(ids), "prompt")
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"Token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
            )
        return ids

    async def chat_ids(
        self,
        messages: Sequence[ChatMessage],
        render: Callable[[list[dict[str, Any]]], list[int]],
    ) -> list[int]:
        """Prompt token ids of chat messages, rendered by `render` (the server's
        `PromptRenderer`, which adds tools and remembered turns)."""
        limit = self.limits.max_seq_len
        if len(messages) >= limit:
            raise APIError(
                400,
                f"{len(messages)} messages cannot fit: each takes at least one token, and "
                f"{self.limits.describe()}",
                param="messages",
                code="context_length_exceeded",
            )
        chars = sum(message.num_chars for message in messages)
        self._check_chars(chars, "messages", "The messages' content")
        template = [m.to_template() for m in messages]
        try:
            ids = await self._run(render, template)
        except ValueError as exc:
            raise APIError(400, f"Invalid messages: {exc}", param="messages") from exc
        check_fits(self.limits, len(ids), "messages")
        return ids

    def _check_chars(self, num_chars: int, param: str, what: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{what} is {num_chars} characters long and cannot fit: no token of this model "
                f"covers more than {self.max_chars_per_token} characters, and "
                f"{self.limits.describe()}; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the tokenizer threads; a 503 when too many wait already."""
        with self._lock:
            if self._pending >= self._max_pending:
                raise APIError(
                    503,
                    f"The server is busy: {self._pending} prompts are being tokenized or waiting; "
                    "retry shortly",
                    code="tokenizer_busy",
                    headers={"Retry-After": str(self.retry_after_s)},
                )
            self._pending += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._release)  # when the thread is done, not when we stop
        return await asyncio.wrap_future(future)

    def _release(self, _: object) -> None:
        with self._lock:
            self._pending -= 1


def check_fits(limits: ModelLimits, prompt_len: int, param: str) -> None:
    """A 400 when a prompt leaves no room for one output token."""
    if prompt_len >= limits.max_seq_len:
        raise APIError(
            400,
            f"The prompt is {prompt_len} tokens long and cannot fit: {limits.describe()}; "
            "shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def json_chars(value: Any) -> int:
    """Characters of a parsed JSON value (pydantic models in it dumped): the strings and keys in
    full, one per other scalar. Iterative, so any depth is safe."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, BaseModel):
            stack.append(item.model_dump(by_alias=True, exclude_none=True))
        elif isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) if isinstance(k, str) else 1 for k in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None:
            total += 1
    return total


def json_values_bound(raw: bytes) -> int:
    """An upper bound on the values in the JSON text `raw` (exact for valid JSON but for one per
    empty container): one more than the commas, brackets and braces outside strings. Escaped
    backslashes, then escaped quotes, are removed first, so every quote left opens or closes a
    string and the parity of the quotes before a byte says whether it is inside one."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(unescaped, dtype=np.uint8)
    inside = np.cumsum(text == ord('"'), dtype=np.uint8) & 1  # uint8 wraps, parity survives
    structural = (text == ord(",")) | (text == ord("[")) | (text == ord("{"))
    return int(np.count_nonzero(structural & (inside == 0))) + 1
