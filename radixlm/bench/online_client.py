"""One /v1/completions or /v1/chat/completions request against any OpenAI-compatible server,
streamed and timed per token, or not streamed.

The prompt is token ids or a string (/v1/completions) or messages (/v1/chat/completions); see
`online_prompts`. `return_token_ids` (vLLM's extension, radixlm's too) brings the prompt and
output ids back, so a dependent request can extend its parent's actual output and the ideal
prefill can be computed from what the server saw; llama-server does it with `"verbose": true`
in the body (each chunk's `__verbose.tokens`); a server without either still works, the child
then extends the parent's prompt only.

With `return_timeline`, radixlm's timeline of the request (where its time to first token went,
stage by stage) is kept from the body or the stream's last chunk.

Behind a gateway, the response headers say which replica answered: radixlm's own
`x-radixlm-worker`, else smg's `x-smg-routed-worker-id`. A stream is checked as it should end:
a usage chunk carrying `cached_tokens`, then `[DONE]`.

A request may be told to disconnect after k tokens: it closes the connection mid-stream, which
is how a real client that gives up looks to the server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORKER_HEADERS = ("x-radixlm-worker", "x-smg-routed-worker-id")


@dataclass(frozen=True)
class ClientOptions:
    base_url: str  # up to and without /v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # generate exactly max_tokens (vLLM/SGLang/radixlm extension)
    return_token_ids: bool = True
    return_timeline: bool = False  # radixlm's per-request timeline (server/timeline.py)
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # server-specific request fields


@dataclass
class RequestRecord:
    """What one request saw, from the client's side."""

    rid: str
    prompt_len: int  # tokens: from usage when the server reports it
    max_tokens: int
    streamed: bool = True
    start_s: float = 0.0  # perf_counter when sent
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None
    disconnected: bool = False  # we closed it on purpose, mid-stream
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between tokens after the first
    latency_s: float = 0.0
    prompt_ids: list[int] | None = None  # as the server tokenized the prompt, when it says
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    num_output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    worker: str | None = None  # the replica that answered, when a response header names it
    usage_then_done: bool = False  # a stream ended with a usage chunk (cached_tokens), [DONE]
    timeline: dict[str, Any] | None = None  # the server's, when asked for and given

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def stream_completion(
    client: httpx.AsyncClient,
    options: ClientOptions,
    rid: str,
    prompt: list[int] | str | list[dict[str, str]],
    max_tokens: int,
    disconnect_after: int | None = None,
    stream: bool = True,
) -> RequestRecord:
    """Send one request (messages go to chat); never raises for HTTP or connection errors."""
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    prompt_len = len(prompt) if isinstance(prompt, list) and not chat else 0
    record = RequestRecord(rid, prompt_len, max_tokens, streamed=stream)
    body: dict[str, Any] = {"model": options.model, "max_tokens": max_tokens, "temperature": 0.0}
    body["messages" if chat else "prompt"] = prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.return_token_ids:
        body["return_token_ids"] = True
    if options.return_timeline:
        body["return_timeline"] = True
    body.update(options.extra_body)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    url = f"{options.base_url}/v1/{'chat/completions' if chat else 'completions'}"
    record.start_s = time.perf_counter()
    try:
        if stream:
            await _stream(client, url, body, headers, record, disconnect_after)
        else:
            response = await client.post(url, json=body, headers=headers)
            record.status, record.worker = response.status_code, _worker(response)
            if response.status_code != 200:
                record.error = response.text[:500]
            else:
                _read_chunk(response.json(), record)
                record.ttft_s = time.perf_counter() - record.start_s  # the whole answer
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency_s = time.perf_counter() - record.start_s
    return record


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    disconnect_after: int | None,
) -> None:
    last: float | None = None
    usage_last = False  # the latest data line was a usage chunk with cached_tokens
    async with client.stream("POST", url, json=body, headers=headers) as response:
        record.status, record.worker = response.status_code, _worker(response)
        if response.status_code != 200:
            record.error = (await response.aread()).decode(errors="replace")[:500]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                record.usage_then_done = usage_last
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = json.dumps(chunk["error"])[:500]
                break
            now = time.perf_counter()
            num_new = _read_chunk(chunk, record)
            usage_last = bool(chunk.get("usage")) and record.cached_tokens is not None
            if num_new:
                if last is None:
                    record.ttft_s = now - record.start_s
                else:
                    record.itl_s.extend([(now - last) / num_new] * num_new)
                last = now
            if disconnect_after is not None and record.num_output_tokens >= disconnect_after:
                record.disconnected = True
                break  # leaving the block closes the connection mid-stream


def _read_chunk(chunk: dict[str, Any], record: RequestRecord) -> int:
    """Fold one chunk (or a whole non-streamed response) into the record; the number of new
    output tokens it carried."""
    if isinstance(chunk.get("timeline"), dict):
        record.timeline = chunk["timeline"]
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
        record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
        record.num_output_tokens = max(record.num_output_tokens, usage["completion_tokens"])
    num_new = 0
    for choice in chunk.get("choices") or []:
        if choice.get("prompt_token_ids") is not None and record.prompt_ids is None:
            record.prompt_ids = list(choice["prompt_token_ids"])
        text = choice.get("text")
        if text is None:  # chat: a stream's delta, or a whole response's message
            text = (choice.get("delta") or choice.get("message") or {}).get("content")
        record.output_text += text or ""
        ids = choice.get("token_ids")
        if ids is None:  # llama-server sends each token's id under "__verbose" when asked to
            ids = (chunk.get("__verbose") or {}).get("tokens")
        if ids is not None:
            record.output_ids.extend(ids)
            num_new += len(ids)
        elif text:
            num_new += 1  # a server without token ids: one chunk per token, as most send
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if not usage:
        record.num_output_tokens += num_new
    return num_new


def _worker(response: httpx.Response) -> str | None:
    return next((response.headers[h] for h in WORKER_HEADERS if h in response.headers), None)
