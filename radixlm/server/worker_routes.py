"""The routes a gateway in front of several replicas calls (smg, SGLang's router lineage):

    GET  /v1/loads       load in SGLang's shape, polled by the gateway's load monitor
    POST /flush_cache    an alias of /v1/cache/flush (the gateway's "flush every worker")
    GET  /server_info    model, context length, slots, version, worker id

and `WorkerHeaderMiddleware`, which names this replica on every response (`x-radixlm-worker`)
so a client behind a gateway can tell which replica served it.

Keys (when the server has any): `/v1/loads` and `/server_info` take a tenant key or the admin
key; `/flush_cache` is cache-wide and takes the admin key only, like `/v1/cache/flush` (a
gateway's "flush every worker" must be given the admin key). A caller without the admin key on a
server whose `--report-cached-tokens` is not "exact" reads the token counts in whole pages and
no hit rate (their differences would give a request's cached length).

"Used" tokens in /v1/loads count only slots that requests hold now: in-flight slots plus tree
nodes locked by running requests. A warm tree is evictable on demand, i.e. free capacity;
reporting it as used would make a gateway's overload veto shun exactly the replicas whose cache
is most valuable. There is deliberately no `/version` route: smg takes a worker that answers one
for vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import radixlm
from radixlm.config import ServerConfig
from radixlm.server.admin_routes import _call, cache_router
from radixlm.server.snapshot import EngineSnapshot, take_snapshot
from radixlm.server.state import ServerState

WORKER_HEADER = "x-radixlm-worker"
WORKER_ROUTES = frozenset({"/v1/loads", "/flush_cache", "/server_info"})


def install_worker_routes(
    app: FastAPI, state: ServerState, viewer: Sequence[Any], admin: Sequence[Any]
) -> None:
    """Add the gateway-facing routes (`viewer`: a tenant key or the admin key; `admin`: the
    admin key) and the header naming this replica."""
    app.include_router(worker_router(state), dependencies=list(viewer))
    app.include_router(flush_router(state), dependencies=list(admin))
    app.add_middleware(WorkerHeaderMiddleware, worker=worker_id(state.config))


def worker_router(state: ServerState) -> APIRouter:
    """/v1/loads and /server_info (a tenant key or the admin key, when keys are set)."""
    router = APIRouter()

    @router.get("/v1/loads")
    async def loads(request: Request) -> JSONResponse:
        # shares /metrics' snapshots: gateways polling together cost one engine round trip
        snapshot = await state.snapshots.get(lambda: _call(state, take_snapshot))
        if not state.tenancy.exact_lengths(request):
            snapshot = _coarse(snapshot, state.tenancy.whole_pages)
        max_running = state.engine.engine.scheduler_config.max_running_requests
        return JSONResponse(loads_body(snapshot, max_running, datetime.now(timezone.utc)))

    @router.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(server_info_body(state))

    return router


def flush_router(state: ServerState) -> APIRouter:
    """POST /flush_cache (the admin key)."""
    router = APIRouter()
    # The very endpoint of /v1/cache/flush, so the alias can never drift from it.
    flush = next(
        route
        for route in cache_router(state).routes
        if isinstance(route, APIRoute) and route.path == "/v1/cache/flush"
    )
    router.add_api_route("/flush_cache", flush.endpoint, methods=["POST"])
    return router


def loads_body(
    snapshot: EngineSnapshot, max_running_requests: int, now: datetime
) -> dict[str, Any]:
    """SGLang's /v1/loads for one data-parallel rank, from one engine snapshot. The counts are
    integers and the timestamp an ISO 8601 string: smg drops a body of any other shape."""
    used = snapshot.num_in_flight + snapshot.num_protected  # held by requests; the rest is free
    stats = snapshot.engine_stats
    queried = stats.get("prompt_tokens", 0)
    load = {
        "dp_rank": 0,
        "num_running_reqs": snapshot.num_running,
        "num_waiting_reqs": snapshot.num_waiting,
        "num_total_reqs": snapshot.num_running + snapshot.num_waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": snapshot.capacity,
        "token_usage": used / snapshot.capacity if snapshot.capacity else 0.0,
        "cache_hit_rate": stats.get("cached_prompt_tokens", 0) / queried if queried else 0.0,
        "num_cached_tokens": snapshot.num_tree_tokens,  # resident in the tree, reusable
        "num_free_tokens": snapshot.num_free,
        "max_running_requests": max_running_requests,
    }
    return {
        "timestamp": now.isoformat(),
        "version": radixlm.__version__,
        "dp_rank_count": 1,
        "loads": [load],
    }


def server_info_body(state: ServerState) -> dict[str, Any]:
    """What never changes while serving (read without the engine thread)."""
    core = state.engine.engine
    return {
        "model": state.model_name,
        "model_path": state.model_name,
        "served_model_name": state.model_name,
        "context_length": state.limits.max_context_len,
        "max_total_num_tokens": state.limits.num_slots,
        "num_slots": state.limits.num_slots,
        "page_size": core.cache_config.page_size,
        "max_running_requests": core.scheduler_config.max_running_requests,
        "version": radixlm.__version__,
        "engine": "radixlm",
        "worker_id": worker_id(state.config),
    }


def _coarse(snapshot: EngineSnapshot, whole_pages: Callable[[int], int]) -> EngineSnapshot:
    """The snapshot as a caller without exact lengths sees it: slot counts in whole pages, no
    cached-token counter (so no hit rate)."""
    stats = {**snapshot.engine_stats, "cached_prompt_tokens": 0}
    return dataclasses.replace(
        snapshot,
        num_free=whole_pages(snapshot.num_free),
        num_tree_tokens=whole_pages(snapshot.num_tree_tokens),
        num_protected=whole_pages(snapshot.num_protected),
        num_in_flight=whole_pages(snapshot.num_in_flight),
        engine_stats=stats,
    )


def worker_id(config: ServerConfig) -> str:
    """This replica's name: --worker-id, else host:port."""
    return config.worker_id or f"{config.host}:{config.port}"


class WorkerHeaderMiddleware:
    """Adds `x-radixlm-worker: ID` to every HTTP response (a pure ASGI middleware, so streams
    pass through untouched)."""

    def __init__(self, app: ASGIApp, worker: str) -> None:
        self.app = app
        self.header = (WORKER_HEADER.encode(), worker.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named_send)
