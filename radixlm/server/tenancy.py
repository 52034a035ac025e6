"""Who sent a request: its key, its tenant and cache namespace, and what it may be told.

A shared prefix cache is a side channel (docs/security.md): without isolation, `cached_tokens`,
a cache report or a tree picture tells a client how much of its prompt someone else sent before.
Tenancy is one concept here: a **tenant** is what `salt_from` derives, and every surface that
reveals cache contents, lengths, reasons or text answers from the caller's own tenant only.

- `Authorization: Bearer KEY` with a tenant key (`api_keys`) or the admin key (`admin_key`); the
  scheme is case-insensitive (RFC 9110); every key is compared in constant time, all of them,
  so timing tells nothing about which nearly matched.
- The tenant: `salt_from="api-key"` gives each key its own (a hash of the key, never the key);
  `"header:NAME"` takes it from a header a trusted proxy sets (a request without it is a 400);
  `"none"`, or a server without keys, has no server-derived tenant: the client's `cache_salt`
  is its tenant. The namespace (the engine's `cache_salt`) is the tenant, subdivided by the
  client's `cache_salt` when there is a derived tenant, so a client cannot name another's.
- The admin key is for cache-wide routes (flush, server-wide statistics) and sees every tenant
  in the observatory; it is never a tenant key (inference routes refuse it). A server with tenant
  keys or header tenants and no admin key has no cache-wide routes at all (403); a server with
  no key of either kind (one local user) leaves them open.
- `report_cached_tokens`: "exact", "page" (rounded down to whole pages) or "none" (omitted),
  for every length a non-admin caller is told (usage, reports, the tree, aggregate counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Hashable

from fastapi import Request

from radixlm.config import ServerConfig
from radixlm.observatory.service import Viewer
from radixlm.server.errors import APIError
from radixlm.server.generation import Usage

_TENANT = "radixlm_tenant"  # request.state attribute: the tenant of the key that matched
_ADMIN = "radixlm_admin"  # request.state attribute: the request carried the admin key
_ADMIN_ROUTE_HELP = "send 'Authorization: Bearer <admin key>'"


class Tenancy:
    """Authentication, tenants and what each caller is told (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self._keys = [key.encode() for key in config.api_keys]
        self._admin = config.admin_key.encode() if config.admin_key else None
        self._salt_header = (
            config.salt_from.removeprefix("header:").lower()
            if config.salt_from.startswith("header:")
            else None
        )
        self._salt_from_key = config.salt_from == "api-key"
        # A derived tenant: a key's or a header's (else a request's salt is its tenant).
        self.derived = self._salt_header is not None or (self._salt_from_key and bool(self._keys))
        self.multi_tenant = bool(self._keys) or self._salt_header is not None
        self._report = config.report_cached_tokens
        self.page = config.cached_tokens_page

    # -- dependencies (FastAPI) --------------------------------------------------------------

    async def authenticate(self, request: Request) -> None:
        """Inference routes: 401 unless the request carries a tenant key (when there are any)."""
        if not self._keys:
            return
        if self._match(request) is None:
            raise _unauthorized("send 'Authorization: Bearer <key>'")

    async def authenticate_viewer(self, request: Request) -> None:
        """Observatory and gateway routes: a tenant key or the admin key (when keys are set)."""
        matched = self._match(request)
        if self._keys and matched is None and not self._is_admin(request):
            raise _unauthorized("send 'Authorization: Bearer <key>'")

    async def authenticate_admin(self, request: Request) -> None:
        """Cache-wide routes: the admin key; refused on a multi-tenant server without one."""
        self._match(request)
        if self._is_admin(request):
            return
        if self._admin is not None:
            raise _unauthorized(_ADMIN_ROUTE_HELP, "This route needs the admin key")
        if self.multi_tenant:
            raise APIError(
                403,
                "Cache-wide routes need the admin key, and this server has none: start it with "
                "--admin-key (tenant keys never act on the whole cache)",
                code="admin_key_required",
            )
        setattr(request.state, _ADMIN, True)  # one local user: nobody to tell apart

    # -- who the caller is -------------------------------------------------------------------

    def namespace(self, request: Request, cache_salt: str | None) -> str | None:
        """The cache namespace of one request: the server-derived tenant, subdivided by the
        client's cache_salt when it sent one."""
        tenant = self._derived_tenant(request)
        if tenant is None:
            return cache_salt
        return tenant if cache_salt is None else f"{tenant}/{cache_salt}"

    def tenant_of(self, namespace: str | None) -> Hashable:
        """The tenant a namespace belongs to: its derived part, or the whole salt."""
        if self.derived and namespace is not None:
            return namespace.partition("/")[0]
        return namespace

    def viewer(self, request: Request, cache_salt: str | None = None) -> Viewer:
        """Who reads the observatory: the operator (admin key), or the caller's tenant; where
        no tenant is derived, `cache_salt` (a query parameter) names it."""
        if self._is_admin(request):
            return Viewer(operator=True)
        if self.derived:
            return Viewer(self._derived_tenant(request))
        return Viewer(cache_salt)

    # -- what the caller is told ---------------------------------------------------------------

    def exact_lengths(self, request: Request | None = None) -> bool:
        """Whether lengths reach this caller exactly (the admin always; else by the option)."""
        return self._report == "exact" or (request is not None and self._is_admin(request))

    def reported(self, usage: Usage) -> Usage:
        """The usage as the client is told it: cached_tokens exact, rounded down, or left out."""
        if self._report == "exact" or usage.cached_tokens is None:
            return usage
        if self._report == "none":
            return dataclasses.replace(usage, cached_tokens=None)
        return dataclasses.replace(usage, cached_tokens=self.whole_pages(usage.cached_tokens))

    def whole_pages(self, num_tokens: int) -> int:
        """`num_tokens` rounded down to whole pages (aggregate counts shown coarsely)."""
        return num_tokens // self.page * self.page

    # -- helpers -----------------------------------------------------------------------------

    def _match(self, request: Request) -> bytes | None:
        """The tenant key the request carries (None if none), recording its tenant and whether
        it carried the admin key. Every key is compared, with no early exit."""
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = None
        for key in self._keys:
            if hmac.compare_digest(given, key):
                matched = key
        admin = self._admin is not None and hmac.compare_digest(given, self._admin)
        if matched is not None:
            setattr(request.state, _TENANT, "key:" + _digest(matched))
        if admin:
            setattr(request.state, _ADMIN, True)
        return matched

    def _is_admin(self, request: Request) -> bool:
        return bool(getattr(request.state, _ADMIN, False))

    def _derived_tenant(self, request: Request) -> str | None:
        if self._salt_header is not None:
            value = request.headers.get(self._salt_header, "")
            if not value:
                raise APIError(
                    400,
                    f"This server isolates its prefix cache by the {self._salt_header!r} header; "
                    "the request has none",
                    param=self._salt_header,
                )
            return "header:" + _digest(value.encode())
        if self._salt_from_key:
            tenant = getattr(request.state, _TENANT, None)
            return tenant if isinstance(tenant, str) else None
        return None


def _unauthorized(how: str, what: str = "Missing or incorrect API key") -> APIError:
    return APIError(401, f"{what}: {how}", code="invalid_api_key")


def _digest(secret: bytes) -> str:
    return hashlib.sha256(b"radixlm-namespace\0" + secret).hexdigest()[:32]
