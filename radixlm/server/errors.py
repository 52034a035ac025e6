"""Errors as OpenAI reports them: a status code and `{"error": {message, type, param, code}}`.

Routes raise `APIError`; `install_error_handlers` turns it, a schema `ValidationError`, a query or
path parameter FastAPI could not read (its 422 becomes our 400) and an HTTP error from the router
(404, 405) into that body; `ErrorMiddleware` turns any unexpected exception into a 500 of the same
shape, logged once, inside the request counter (so it is counted). A client never sees an HTML
page or a bare traceback, and the server keeps serving after every one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.server.protocol import ParamError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as-is (the route decided the status and the message)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(APIError):
    """The client went away before its response; nobody reads this 499 (nginx's code)."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem of a request that failed its schema, as a 400 naming the parameter."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = [str(part) for part in err["loc"]]
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag is not None:  # no member of a union matched: name the value, list the members
        union = ".".join(loc[:tag])
        members = dict.fromkeys(
            str(e["loc"][tag]) for e in errors if [str(p) for p in e["loc"][:tag]] == loc[:tag]
        )
        expected = " or ".join(members)
        return APIError(400, f"Invalid value for {union!r}: expected {expected}", param=union)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return APIError(400, str(cause), param=cause.param)
    if err["type"] == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" and not loc:
        return APIError(400, "The request body must be a JSON object")
    param = ".".join(loc) or None
    if param is None:  # a check on the whole request
        return APIError(400, err["msg"].removeprefix("Value error, "))
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param)
    message = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"Invalid value for {param!r}: {message}", param=param)


def from_request_validation_error(exc: RequestValidationError) -> APIError:
    """A query, path or header parameter FastAPI could not read, as a 400 naming it."""
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ())]
    where = loc[0] if loc else ""
    param = ".".join(loc[1:] if where in ("query", "path", "header", "cookie", "body") else loc)
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if not param:
        return APIError(400, f"Invalid request: {message}")
    return APIError(400, f"Invalid value for {param!r}: {message}", param=param)


def _is_union_tag(part: str) -> bool:
    """Pydantic names the union member an error belongs to in its location: 'str',
    'list[TextPart]', 'TextPart'; field names are lower-case identifiers."""
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        message = {404: f"Unknown route: {request.method} {request.url.path}"}.get(
            exc.status_code, str(exc.detail)
        )
        return APIError(exc.status_code, message, headers=exc.headers).response()

    async def on_invalid_parameter(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_request_validation_error(exc).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_invalid_parameter)


class ErrorMiddleware:
    """Any exception a route did not turn into an APIError: logged once with its traceback and
    answered as a 500 in the OpenAI shape (when the response has not started yet). It is not
    re-raised, so neither Starlette nor uvicorn logs it a second time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            if not started:
                response = APIError(500, f"Internal server error: {type(exc).__name__}").response()
                await response(scope, receive, send)
