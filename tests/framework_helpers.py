"""The agent frameworks' conformance suite: a live server that records what each step of a
framework's loop was told about its prompt, and the rule every loop must keep.

    with framework_server(tmp_path) as (server, steps):   # tiny random model, no network
        ... run a framework's loop against server.url + "/v1" ...
        check_cached_steps(steps.taken())                   # from step 2: everything computed

The recorder wraps the app and reads each generating request's usage from its answer (JSON,
Chat Completions chunks or Responses events), so no framework has to expose it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from helpers import sse_lines
from live_server import LiveServer, live_server, save_tiny_chat_model
from starlette.types import ASGIApp, Message, Receive, Scope, Send

GENERATING = ("/v1/chat/completions", "/v1/responses")


class Step(NamedTuple):
    path: str
    request: dict[str, Any]
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None

    @property
    def computed(self) -> int:
        """What this step left computed in the tree: its prompt and every output token but the
        last, whose KV no forward pass has made yet."""
        assert self.prompt_tokens is not None and self.completion_tokens is not None
        return self.prompt_tokens + self.completion_tokens - 1


class StepRecorder:
    """ASGI middleware: one Step per generating request, in the order they finish."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._steps: list[Step] = []

    def taken(self) -> list[Step]:
        """The steps since the last call (and forgets them)."""
        steps, self._steps = self._steps, []
        return steps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATING:
            await self.app(scope, receive, send)
            return
        body: list[bytes] = []
        answer: list[bytes] = []
        status = 0
        recorded = False

        async def receiving() -> Message:
            message = await receive()
            body.append(message.get("body", b""))
            return message

        async def sending(message: Message) -> None:
            nonlocal status, recorded
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not recorded:
                answer.append(message.get("body", b""))
                whole = b"".join(answer)
                # recorded before the client has its last byte: a stream's client stops reading
                # at its terminal event, before the empty chunk that closes the body
                if not message.get("more_body", False) or _ends_stream(whole):
                    request = json.loads(b"".join(body) or b"{}")
                    self._steps.append(Step(scope["path"], request, status, *_usage(whole)))
                    recorded = True
            await send(message)

        await self.app(scope, receiving, sending)


@contextmanager
def framework_server(path: Path) -> Iterator[tuple[LiveServer, StepRecorder]]:
    """A live server on the tiny chat model (context 4096), its requests recorded."""
    model = save_tiny_chat_model(path, context_len=4096)
    recorders: list[StepRecorder] = []

    def wrap(app: ASGIApp) -> ASGIApp:
        recorders.append(StepRecorder(app))
        return recorders[-1]

    with live_server(model, wrap=wrap) as server:
        yield server, recorders[0]


def check_cached_steps(steps: list[Step], min_steps: int = 2) -> None:
    """The loop's rule: every step succeeded, and from step 2 on the cached prefix is
    everything the previous step computed (its prompt and output: nothing recomputed)."""
    assert len(steps) >= min_steps, steps
    for step in steps:
        assert step.status == 200 and step.cached_tokens is not None, step
    for before, after in itertools.pairwise(steps):
        assert after.cached_tokens == before.computed, (before, after)


def check_idle(server: LiveServer) -> None:
    cache = server.wait_idle()
    assert cache["idle"] and cache["accounting_ok"] and cache["integrity"] == "ok", cache


def _ends_stream(answer: bytes) -> bool:
    """Whether a stream's terminal event is in `answer` (Chat Completions' [DONE], or a
    Responses event that ends the response)."""
    tail = answer[-65536:]
    return tail.endswith(b"data: [DONE]\n\n") or any(
        b"event: response." + end + b"\n" in tail
        for end in (b"completed", b"incomplete", b"failed")
    )


def _usage(answer: bytes) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) tokens from a JSON answer or the last usage of a stream."""
    found: dict[str, Any] | None = None
    text = answer.decode(errors="replace")
    streamed = text.startswith(("data:", "event:"))
    lines = [line.removeprefix("data: ") for line in sse_lines(text) if line.startswith("data: ")]
    payloads = lines if streamed else [text]
    for payload in payloads:
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            continue  # data: [DONE]
        response = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        found = response.get("usage") or obj.get("usage") or found
    if not found:
        return None, None, None
    if "input_tokens" in found:  # the Responses API's names
        details = found.get("input_tokens_details") or {}
        return found["input_tokens"], found["output_tokens"], details.get("cached_tokens")
    details = found.get("prompt_tokens_details") or {}
    return found["prompt_tokens"], found["completion_tokens"], details.get("cached_tokens")
