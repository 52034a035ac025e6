"""Who sent a request: the API key check, the cache namespace it gets, what it is told it hit.

A shared prefix cache is a side channel (docs/security.md): without isolation, `cached_tokens`
and the time to first token tell a client how much of its prompt someone else sent before. The
rules here:

- `Authorization: Bearer KEY` with any configured key (the scheme is case-insensitive, RFC 9110;
  every key is compared in constant time, all of them, so timing tells nothing about which).
- The namespace (the engine's `cache_salt`) is derived by the server, never chosen freely:
  `salt_from="api-key"` gives each key its own namespace (a hash of the key, never the key);
  `"header:NAME"` takes it from a header a trusted proxy sets (a request without it is a 400);
  `"none"` leaves isolation to the client's own `cache_salt`. A client's `cache_salt` only
  subdivides its server-derived namespace, so it cannot name another tenant's.
- `report_cached_tokens`: "exact", "page" (rounded down to whole pages) or "none" (omitted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

from fastapi import Request

from radixlm.config import ServerConfig
from radixlm.server.errors import APIError
from radixlm.server.generation import Usage

_TENANT = "radixlm_tenant"  # request.state attribute: the namespace of the key that matched


class Tenancy:
    """Authentication and cache isolation for one server (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self._keys = [key.encode() for key in config.api_keys]
        self._salt_header = (
            config.salt_from.removeprefix("header:").lower()
            if config.salt_from.startswith("header:")
            else None
        )
        self._salt_from_key = config.salt_from == "api-key"
        self._report = config.report_cached_tokens
        self._page = config.cached_tokens_page

    @property
    def requires_key(self) -> bool:
        return bool(self._keys)

    async def authenticate(self, request: Request) -> None:
        """A FastAPI dependency: 401 unless the request carries one of the keys."""
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = None
        for key in self._keys:  # no early exit: the time taken does not depend on which
            if hmac.compare_digest(given, key):
                matched = key
        if matched is None:
            raise APIError(
                401,
                "Missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        setattr(request.state, _TENANT, "key:" + _digest(matched))

    def namespace(self, request: Request, cache_salt: str | None) -> str | None:
        """The cache namespace of one request: the server-derived tenant, subdivided by the
        client's cache_salt when it sent one."""
        tenant: str | None = None
        if self._salt_header is not None:
            value = request.headers.get(self._salt_header, "")
            if not value:
                raise APIError(
                    400,
                    f"This server isolates its prefix cache by the {self._salt_header!r} header; "
                    "the request has none",
                    param=self._salt_header,
                )
            tenant = "header:" + _digest(value.encode())
        elif self._salt_from_key:
            tenant = getattr(request.state, _TENANT, None)
        if tenant is None:
            return cache_salt
        return tenant if cache_salt is None else f"{tenant}/{cache_salt}"

    def reported(self, usage: Usage) -> Usage:
        """The usage as the client is told it: cached_tokens exact, rounded down, or left out."""
        if self._report == "exact" or usage.cached_tokens is None:
            return usage
        if self._report == "none":
            return dataclasses.replace(usage, cached_tokens=None)
        pages = usage.cached_tokens // self._page
        return dataclasses.replace(usage, cached_tokens=pages * self._page)


def _digest(secret: bytes) -> str:
    return hashlib.sha256(b"radixlm-namespace\0" + secret).hexdigest()[:32]
