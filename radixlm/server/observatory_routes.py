"""HTTP for the observatory (radixlm/observatory/, a library this module calls):

    GET /v1/cache/report   the caller's misses, grouped (a tenant key: its tenant's ring;
                           the admin key: every ring)
    GET /v1/cache/tree     the tree as a bounded picture (a tenant key: its own namespaces
                           only; the admin key: all of them)
    GET /cache             the page drawing both: public, static, holds no data; its script
                           asks for the key and sends it on its own requests

and the `cache_report` a response carries when its request set `return_cache_report`: a
non-streamed response gets a top-level "cache_report"; a stream gets it in its first chunk (an
extra key, which OpenAI clients ignore). It is one report, or a list of them, one per prompt, for
a /v1/completions batch. `None` is sent as null ("not available": a server without a tree, or
one whose `--report-cached-tokens` is not "exact": a report places the divergence to the token,
finer than that option allows), so a client can tell "not available" from "not asked".

Where no tenant is derived from a key or a header (`--salt-from none`, a server without keys),
the salt is the tenant: `?cache_salt=` names it on both data routes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from radixlm.observatory.explain import CacheReport
from radixlm.observatory.page import CACHE_PAGE
from radixlm.observatory.segments import SegmentMap
from radixlm.server.errors import APIError
from radixlm.server.state import ServerState

Reports = Sequence["asyncio.Task[CacheReport | None]"]


def observatory_router(state: ServerState) -> APIRouter:
    """The data routes (mounted behind `Tenancy.authenticate_viewer`)."""
    router = APIRouter()
    observatory, tenancy = state.observatory, state.tenancy

    @router.get("/v1/cache/report")
    async def cache_report(request: Request, cache_salt: str | None = None) -> JSONResponse:
        _check_exact(state, request)
        return JSONResponse(observatory.summary(tenancy.viewer(request, cache_salt)))

    @router.get("/v1/cache/tree")
    async def cache_tree(
        request: Request, max_nodes: int = Query(400, ge=1, le=5000), cache_salt: str | None = None
    ) -> JSONResponse:
        _check_exact(state, request)
        viewer = tenancy.viewer(request, cache_salt)
        if not state.engine.is_running:
            raise APIError(503, "The engine is not running")
        return JSONResponse(await observatory.tree_picture(max_nodes, viewer))

    return router


def cache_page_router() -> APIRouter:
    """`GET /cache`: public, so a browser can open it; it carries no data (see page.py)."""
    router = APIRouter()

    @router.get("/cache")
    async def cache_page() -> HTMLResponse:
        return HTMLResponse(CACHE_PAGE, headers={"Cache-Control": "no-store"})

    return router


def start_report(
    state: ServerState,
    prompt: Sequence[int],
    namespace: str | None,
    segments: Callable[[], SegmentMap] | None = None,
) -> asyncio.Task[CacheReport | None]:
    """The cache report of one prompt, started before its request is submitted (see
    Observatory.report_soon); a finished None where lengths are not reported exactly."""
    if not state.tenancy.exact_lengths():
        return asyncio.ensure_future(_nothing())
    return state.observatory.report_soon(prompt, namespace, segments)


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


# ---- helpers --------------------------------------------------------------------------------
def _check_exact(state: ServerState, request: Request) -> None:
    """A 403 for a tenant of a server that reports lengths only coarsely: the tree and the
    misses give every length exactly."""
    if not state.tenancy.exact_lengths(request):
        raise APIError(
            403,
            "This server reports cached lengths only as --report-cached-tokens "
            f"{state.config.report_cached_tokens!r} says; the cache tree and reports show them "
            "exactly, so they are for the admin key only",
            code="lengths_not_reported",
        )


async def _nothing() -> None:
    return None


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
