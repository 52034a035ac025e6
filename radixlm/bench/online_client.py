"""One streamed /v1/completions request against any OpenAI-compatible server, timed per token.

The prompt goes as token ids (the workload generators work in ids, and every OpenAI-compatible
server accepts them). `return_token_ids` (vLLM's extension, radixlm's too) brings the output ids
back so a dependent request can extend its parent's actual output; llama-server does it with
`"verbose": true` in the body (each chunk's `__verbose.tokens`); a server without either still
works, the child then extends the parent's prompt only.

A request may be told to disconnect after k tokens: it closes the connection mid-stream, which
is how a real client that gives up looks to the server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class ClientOptions:
    base_url: str  # up to and without /v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # generate exactly max_tokens (vLLM/SGLang/radixlm extension)
    return_token_ids: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # server-specific request fields


@dataclass
class RequestRecord:
    """What one request saw, from the client's side."""

    rid: str
    prompt_len: int
    max_tokens: int
    start_s: float = 0.0  # perf_counter when sent
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None
    disconnected: bool = False  # we closed it on purpose, mid-stream
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between tokens after the first
    latency_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def stream_completion(
    client: httpx.AsyncClient,
    options: ClientOptions,
    rid: str,
    prompt_ids: list[int],
    max_tokens: int,
    disconnect_after: int | None = None,
) -> RequestRecord:
    """Send one streamed completion; never raises for HTTP or connection errors."""
    record = RequestRecord(rid, len(prompt_ids), max_tokens)
    body: dict[str, Any] = {
        "model": options.model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.return_token_ids:
        body["return_token_ids"] = True
    body.update(options.extra_body)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    record.start_s = time.perf_counter()
    last: float | None = None
    try:
        url = f"{options.base_url}/v1/completions"
        async with client.stream("POST", url, json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:500]
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = json.dumps(chunk["error"])[:500]
                    break
                now = time.perf_counter()
                num_new = _read_chunk(chunk, record)
                if num_new:
                    if last is None:
                        record.ttft_s = now - record.start_s
                    else:
                        record.itl_s.extend([(now - last) / num_new] * num_new)
                    last = now
                if disconnect_after is not None and record.num_output_tokens >= disconnect_after:
                    record.disconnected = True
                    break  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency_s = time.perf_counter() - record.start_s
    return record


def _read_chunk(chunk: dict[str, Any], record: RequestRecord) -> int:
    """Fold one chunk into the record; the number of new output tokens it carried."""
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
        record.num_output_tokens = max(record.num_output_tokens, usage["completion_tokens"])
    num_new = 0
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        if ids is None:  # llama-server sends each token's id under "__verbose" when asked to
            ids = (chunk.get("__verbose") or {}).get("tokens")
        if ids is not None:
            record.output_ids.extend(ids)
            num_new += len(ids)
        elif choice.get("text"):
            num_new += 1  # a server without token ids: one chunk per token, as most send
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if not usage:
        record.num_output_tokens += num_new
    return num_new
