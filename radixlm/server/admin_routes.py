"""The operator's routes: GET /health, GET /metrics, GET /v1/cache, POST /v1/cache/flush.

Keys: `/health` is open. `/v1/cache` (server-wide statistics, the integrity walk) and
`/v1/cache/flush` are cache-wide: the admin key (`Tenancy.authenticate_admin`; refused on a
multi-tenant server that has none). `/metrics` takes the admin key once one is set, and is open
otherwise (Prometheus), its lengths then as `--report-cached-tokens` says.

`/health` never waits for the engine thread (it answers while a long prefill computes); the
others read the engine through `AsyncEngine.call`, between two steps, with a time limit so a
stuck engine makes them fail loudly instead of hanging. `/metrics` shares its snapshots
(`SnapshotCache`), so a flood of scrapes does not queue a command per scrape ahead of the
streams' next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixlm.engine.engine import Engine
from radixlm.server.errors import APIError
from radixlm.server.snapshot import EngineSnapshot, flush_cache, take_snapshot
from radixlm.server.state import ServerState

ENGINE_CALL_TIMEOUT_S = 30.0
T = TypeVar("T")


def health_router(state: ServerState) -> APIRouter:
    """Liveness (open) and metrics (the admin key once one is set)."""
    router = APIRouter()
    tenancy = state.tenancy
    metrics_guard = [Depends(tenancy.authenticate_admin)] if state.config.admin_key else []

    @router.get("/health")
    async def health() -> JSONResponse:
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics", dependencies=metrics_guard)
    async def metrics(request: Request) -> Response:
        try:
            snapshot: EngineSnapshot | None = await state.snapshots.get(
                lambda: _call(state, take_snapshot)
            )
        except APIError:
            snapshot = None  # still expose what the server itself counted
        text = state.metrics.render(snapshot, tenancy.exact_lengths(request), tenancy.page)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router


def cache_router(state: ServerState) -> APIRouter:
    """The prefix cache's statistics and flush (mounted behind the admin key)."""
    router = APIRouter()

    @router.get("/v1/cache")
    async def cache(check_integrity: bool = False) -> JSONResponse:
        snapshot, isa = await _call(state, lambda e: (take_snapshot(e), e.runner.kernels_isa))
        out = snapshot.to_dict()
        out["kernels_isa"] = isa  # the native kernel variant serving (None: PyTorch paths)
        if check_integrity:
            out["integrity"] = await _call(state, _integrity)
        return JSONResponse(out)

    @router.post("/v1/cache/flush")
    async def flush() -> JSONResponse:
        flushed = await _call(state, flush_cache)
        snapshot = await _call(state, take_snapshot)
        return JSONResponse({"flushed_tokens": flushed, "cache": snapshot.to_dict()})

    return router


async def _call(state: ServerState, fn: Callable[[Engine], T]) -> T:
    if not state.engine.is_running:
        raise APIError(503, "The engine is not running")
    try:
        return await asyncio.wait_for(state.engine.call(fn), ENGINE_CALL_TIMEOUT_S)
    except TimeoutError:
        raise APIError(503, "The engine did not answer in time") from None


def _integrity(engine: Engine) -> str:
    """'ok', or why the cache's invariants do not hold."""
    try:
        engine.cache.check_integrity()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
