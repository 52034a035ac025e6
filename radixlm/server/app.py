"""The FastAPI app: `create_app(async_engine, server_config)` wires the routes of one server.

    /health, /metrics                      open (liveness probes and Prometheus need no key)
    /v1/models, /v1/completions,
    /v1/chat/completions, /v1/cache,
    /v1/cache/flush                        behind `Authorization: Bearer KEY` when a key is set

The app does not own the engine's lifecycle: whoever built the AsyncEngine starts it before
serving and shuts it down after (`radixlm serve`, the test fixtures). Everything per-server
(metrics registry, limits, config) hangs off a `ServerState`, so two apps in one process never
share anything.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request

from radixlm.config import ServerConfig
from radixlm.engine.async_engine import AsyncEngine
from radixlm.server.admin_routes import cache_router, health_router
from radixlm.server.errors import APIError, install_error_handlers
from radixlm.server.metrics import RequestCounterMiddleware
from radixlm.server.openai_routes import openai_router
from radixlm.server.state import ServerState
from radixlm.server.worker_routes import WORKER_ROUTES, install_worker_routes

ROUTES = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/cache",
        "/v1/cache/flush",
    }
)


def create_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState.build(engine, config)
    app = FastAPI(title="radixlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.radixlm = state
    install_error_handlers(app)
    guarded = [Depends(_api_key_check(config.api_key))] if config.api_key else []
    app.include_router(health_router(state))
    app.include_router(openai_router(state), dependencies=guarded)
    app.include_router(cache_router(state), dependencies=guarded)
    install_worker_routes(app, state, guarded)  # what a gateway in front of replicas calls
    app.add_middleware(
        RequestCounterMiddleware, metrics=state.metrics, routes=ROUTES | WORKER_ROUTES
    )
    return app


def _api_key_check(api_key: str):  # -> a FastAPI dependency
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "Missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check
