"""The FastAPI app: `create_app(async_engine, server_config)` wires the routes of one server.

    /health                                open (liveness probes need no key)
    /cache (the tree page)                 open: static HTML with no data; its script asks for
                                           the key and sends it on the data routes below
    /v1/models, /v1/completions,
    /v1/chat/completions, /v1/responses
    (and /v1/responses/{id})               a tenant key, when keys are set
    /v1/cache/report, /v1/cache/tree,
    /v1/loads, /server_info                a tenant key (its own tenant's view) or the admin key
                                           (everything), when keys are set
    /v1/cache, /v1/cache/flush,
    /flush_cache                           the admin key (refused on a multi-tenant server
                                           without one; open on a server with no key at all)
    /metrics                               the admin key once one is set, else open

(server/tenancy.py owns the rules, docs/security.md lists what each surface shows a tenant.)

Around the routes, outermost first: the request counter (every response is counted, 500s and
413s included), `ErrorMiddleware` (an unexpected exception is one logged 500),
`TimelineMiddleware` (each request's clock, started as it arrives; its stages to the metrics)
and `BodyLimitMiddleware` (bodies are read within their size and time limits before any route).

The app does not own the engine's lifecycle: whoever built the AsyncEngine starts it before
serving and shuts it down after (`radixlm serve`, the test fixtures). Everything per-server
(metrics registry, limits, tokenizer threads, config) hangs off a `ServerState`, so two apps in
one process never share anything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from radixlm.config import ServerConfig
from radixlm.engine.async_engine import AsyncEngine
from radixlm.server.admin_routes import cache_router, health_router
from radixlm.server.body import BodyLimitMiddleware
from radixlm.server.errors import ErrorMiddleware, install_error_handlers
from radixlm.server.metrics import RequestCounterMiddleware
from radixlm.server.observatory_routes import cache_page_router, observatory_router
from radixlm.server.openai_routes import openai_router
from radixlm.server.responses_api.routes import responses_router
from radixlm.server.state import ServerState
from radixlm.server.timeline import TimelineMiddleware
from radixlm.server.worker_routes import WORKER_ROUTES, install_worker_routes

ROUTES = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/cache",
        "/v1/cache/flush",
        "/v1/cache/report",
        "/v1/cache/tree",
        "/cache",
    }
)


def create_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState.build(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.bounds.close()  # the tokenizer threads end with the server

    app = FastAPI(
        title="radixlm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.radixlm = state
    install_error_handlers(app)
    tenancy = state.tenancy
    tenant = [Depends(tenancy.authenticate)]
    viewer = [Depends(tenancy.authenticate_viewer)]
    admin = [Depends(tenancy.authenticate_admin)]
    app.include_router(health_router(state))
    app.include_router(cache_page_router())
    app.include_router(openai_router(state), dependencies=tenant)
    app.include_router(responses_router(state), dependencies=tenant)
    app.include_router(cache_router(state), dependencies=admin)
    app.include_router(observatory_router(state), dependencies=viewer)
    install_worker_routes(app, state, viewer, admin)  # what a gateway in front of replicas calls
    # add_middleware wraps what is there: the last one added runs first
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_s,
        idle_timeout_s=config.body_idle_timeout_s,
    )
    app.add_middleware(TimelineMiddleware, observer=state.metrics)
    app.add_middleware(ErrorMiddleware)
    app.add_middleware(
        RequestCounterMiddleware, metrics=state.metrics, routes=ROUTES | WORKER_ROUTES
    )
    return app
