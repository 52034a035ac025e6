"""HTTP: `GET /v1/cache/report` (the misses' summary), `GET /v1/cache/tree` (the tree as a
bounded picture), `GET /cache` (the page drawing both), and the `cache_report` a chat response
carries when its request set `return_cache_report`.

A non-streamed response gets a top-level "cache_report" object; a stream gets it in its first
chunk (an extra key, which OpenAI clients ignore). `None` (a server without a tree) is sent as
null, so a client can tell "not available" from "not asked".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from radixlm.observatory.explain import CacheReport
from radixlm.observatory.page import CACHE_PAGE
from radixlm.observatory.service import Observatory
from radixlm.server.errors import APIError


def observatory_router(observatory: Observatory) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/cache/report")
    async def cache_report() -> JSONResponse:
        return JSONResponse(observatory.misses.summary())

    @router.get("/v1/cache/tree")
    async def cache_tree(max_nodes: int = Query(400, ge=1, le=5000)) -> JSONResponse:
        if not observatory.engine.is_running:
            raise APIError(503, "The engine is not running")
        return JSONResponse(await observatory.tree_picture(max_nodes))

    @router.get("/cache")
    async def cache_page() -> HTMLResponse:
        return HTMLResponse(CACHE_PAGE)

    return router


def with_cache_report(response: Response, report: CacheReport | None) -> Response:
    """`response` with the report added (a JSON body, or the first event of a stream); any
    other response (an error) is returned as it is."""
    value = report.to_dict() if report is not None else None
    if isinstance(response, StreamingResponse):
        response.body_iterator = _first_chunk_with(response.body_iterator, value)
        return response
    if isinstance(response, JSONResponse) and response.status_code == 200:
        body = json.loads(bytes(response.body))
        body["cache_report"] = value
        return JSONResponse(body, status_code=200)
    return response


async def _first_chunk_with(
    chunks: AsyncIterable[Any], value: dict[str, Any] | None
) -> AsyncIterator[Any]:
    first = True
    async for chunk in chunks:
        text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
        if first and text.startswith("data: {"):
            event = json.loads(text[len("data: ") :])
            event["cache_report"] = value
            text = f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
            first = False
        yield text
