"""HTTP: `GET /v1/cache/report` (the misses' summary) and `GET /v1/cache/tree` (the tree as a
bounded picture), behind the API key; `GET /cache` (the page drawing both), public: the page is
static and holds no data, its script asks for the key and sends it on its own requests. And the
`cache_report` a response carries when its request set `return_cache_report`.

A non-streamed response gets a top-level "cache_report"; a stream gets it in its first chunk (an
extra key, which OpenAI clients ignore). It is one report, or a list of them, one per prompt, for
a /v1/completions batch. `None` (a server without a tree) is sent as null, so a client can tell
"not available" from "not asked".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from radixlm.observatory.explain import CacheReport
from radixlm.observatory.page import CACHE_PAGE
from radixlm.observatory.service import Observatory
from radixlm.server.errors import APIError


def observatory_router(observatory: Observatory) -> APIRouter:
    """The data routes (mounted behind the API key when keys are set)."""
    router = APIRouter()

    @router.get("/v1/cache/report")
    async def cache_report() -> JSONResponse:
        return JSONResponse(observatory.misses.summary())

    @router.get("/v1/cache/tree")
    async def cache_tree(max_nodes: int = Query(400, ge=1, le=5000)) -> JSONResponse:
        if not observatory.engine.is_running:
            raise APIError(503, "The engine is not running")
        return JSONResponse(await observatory.tree_picture(max_nodes))

    return router


def cache_page_router() -> APIRouter:
    """`GET /cache`: public, so a browser can open it; it carries no data (see page.py)."""
    router = APIRouter()

    @router.get("/cache")
    async def cache_page() -> HTMLResponse:
        return HTMLResponse(CACHE_PAGE, headers={"Cache-Control": "no-store"})

    return router


Reports = Sequence["asyncio.Task[CacheReport | None]"]


async def with_cache_report(response: Response, reports: Reports, batch: bool = False) -> Response:
    """`response` with the reports added once they are ready (a JSON body, or the first event
    of a stream): one report, or with `batch` a list of them. Any other response (an error) is
    returned as it is, its reports dropped."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _first_chunk_with(response.body_iterator, reports, batch)
        return response
    if isinstance(response, JSONResponse) and response.status_code == 200:
        body = json.loads(bytes(response.body))
        body["cache_report"] = await _value(reports, batch)
        return JSONResponse(body, status_code=200)
    for task in reports:
        task.cancel()
    return response


async def _value(reports: Reports, batch: bool) -> Any:
    done = [r.to_dict() if r is not None else None for r in await asyncio.gather(*reports)]
    return done if batch else done[0]


async def _first_chunk_with(
    chunks: AsyncIterable[Any], reports: Reports, batch: bool
) -> AsyncIterator[Any]:
    first = True
    async for chunk in chunks:
        text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
        if first and text.startswith("data: {"):
            value = await _value(reports, batch)
            event = json.loads(text[len("data: ") :])
            event["cache_report"] = value
            text = f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
            first = False
        yield text
