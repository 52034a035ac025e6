"""AsyncEngine: the engine's step loop in a background thread, with an async stream per request.

The engine and its cache are single-threaded; every call that touches them runs in the engine
thread (submitted through a command queue), and results come back to the asyncio loop through
`call_soon_threadsafe`. PyTorch releases the GIL inside its kernels, so the event loop (and
`/health`) stays responsive while a long prefill computes.

The engine is *built* on its thread too, so that every torch call of the process runs there.
libgomp (PyTorch's OpenMP) stops its workers from spin-waiting once it manages more threads than
there are cores, and a team created by the main thread (while loading the model) lives on; with
one, the engine thread's parallel ops would run with sleeping workers, measurably slower.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from radixlm.api_types import SamplingParams, StreamDelta
from radixlm.engine.engine import Engine, ForwardError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamDelta]


class AsyncEngine:
    """`build` makes the Engine; it runs on the engine thread when `start()` is called."""

    def __init__(self, build: Callable[[], Engine]) -> None:
        self._build = build
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._engine: Engine | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="radixlm-engine", daemon=True)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine is not built yet: call start() first")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self) -> None:
        """Build the engine on its thread and start the step loop; returns once it is built and
        raises what building raised (a bad model path, say)."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still running, stop the thread, and wait for it."""
        if not self._thread.is_alive():
            return
        self._submit(self._abort_all)
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- the async API ----------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas until all its n samples finish.

        Raises ValueError (before anything streams) when the engine rejects the request. Closing
        the iterator early (a client that went away) aborts the request.
        """
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        remaining = params.n
        try:
            await self.call(lambda e: e.add_request(prompt_ids, params, rid, namespace))
            while remaining:
                delta = await stream.queue.get()
                if delta.finish_reason is not None:
                    remaining -= 1
                yield delta
        finally:
            if remaining:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._dispatch(self.engine.abort(request_id)))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) in the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, the engine keeps going
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    # ---- the engine thread ------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _loop(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as exc:  # handed to start(), which raises it in the caller
            self._build_error = exc
            return
        finally:
            self._built.set()
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait(0.5)
                self._wakeup.clear()
                continue
            try:
                deltas = self.engine.step()
            except ForwardError as exc:  # fails the requests in that pass, not the others
                log.exception(
                    "a forward pass failed; failing its %d requests", len(exc.request_ids)
                )
                deltas = self.engine.fail(exc.request_ids, "internal error in the forward pass")
            except Exception:
                log.exception("engine step failed; failing the running requests")
                deltas = self.engine.fail_all("internal error in the engine step")
            self._dispatch(deltas)
        self._run_commands()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            with self._lock:
                stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _abort_all(self) -> None:
        self._dispatch(self.engine.fail_all("the server is shutting down", reason="abort"))


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
