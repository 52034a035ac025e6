"""Which key each route takes, and what each caller is told: tenant keys reach inference and
their own tenant's observatory; the admin key reaches the cache-wide routes and every tenant;
a multi-tenant server without an admin key has no cache-wide routes; `--report-cached-tokens`
governs every length a non-admin caller sees."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model
from starlette.requests import Request

from radixlm.cli import build_parser
from radixlm.commands.options import server_config
from radixlm.config import ServerConfig
from radixlm.server.tenancy import Tenancy

pytestmark = pytest.mark.timeout(180)

ALICE, BOB, ADMIN = "alice-key", "bob-key", "root-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tenancy-routes"), context_len=512)


@pytest.fixture(scope="module")
def keyed(model: Path) -> Iterator[LiveServer]:
    config = ServerConfig(api_keys=(ALICE, BOB), admin_key=ADMIN, model_name="tiny")
    with live_server(model, api_key=ALICE, server=config) as live:
        yield live


def status(server: LiveServer, method: str, path: str, key: str | None) -> int:
    headers = bearer(key) if key else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=60).status_code


def chat(server: LiveServer, key: str, system: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "hi"}], "max_tokens": 2, **extra}  # fmt: skip
    response = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60
    )
    assert response.status_code == 200, response.text
    server.wait_idle()
    out: dict[str, Any] = response.json()
    return out


def test_each_route_takes_its_key(keyed: LiveServer) -> None:
    for path in ("/v1/cache", "/metrics"):
        assert [status(keyed, "GET", path, k) for k in (None, ALICE, ADMIN)] == [401, 401, 200]
    for path in ("/v1/cache/flush", "/flush_cache"):
        assert [status(keyed, "POST", path, k) for k in (None, BOB, ADMIN)] == [401, 401, 200]
    for path in ("/v1/cache/report", "/v1/cache/tree", "/v1/loads", "/server_info"):
        assert [status(keyed, "GET", path, k) for k in (None, BOB, ADMIN)] == [401, 200, 200]
    # the admin key is no tenant key: it cannot run requests in anyone's namespace
    assert [status(keyed, "GET", "/v1/models", k) for k in (ADMIN, BOB)] == [401, 200]
    assert status(keyed, "GET", "/health", None) == status(keyed, "GET", "/cache", None) == 200


def test_a_tenant_sees_its_own_tree_and_ring_and_the_admin_sees_all(keyed: LiveServer) -> None:
    chat(keyed, ALICE, "Alice's system prompt.", return_cache_report=True)
    chat(keyed, BOB, "Bob's system prompt.", return_cache_report=True)

    def texts(key: str) -> str:
        response = httpx.get(keyed.url + "/v1/cache/report", headers=bearer(key), timeout=30)
        return str(response.json()["recent"])

    assert "Alice" in texts(ALICE) and "Bob" not in texts(ALICE)
    assert "Bob" in texts(BOB) and "Alice" not in texts(BOB)
    assert "Alice" in texts(ADMIN) and "Bob" in texts(ADMIN)

    def roots(key: str) -> int:
        tree = httpx.get(keyed.url + "/v1/cache/tree", headers=bearer(key), timeout=30).json()
        picture_tokens = sum(n["tokens"] for n in tree["nodes"])
        assert tree["num_tokens"] == picture_tokens or key == ADMIN
        return sum(n["parent"] is None for n in tree["nodes"])

    assert roots(ALICE) == roots(BOB) == 1  # its own namespace only
    assert roots(ADMIN) >= 2  # every namespace


def test_a_multi_tenant_server_without_an_admin_key_has_no_cache_wide_routes(model: Path) -> None:
    config = ServerConfig(api_keys=(ALICE,), model_name="tiny")
    with live_server(model, api_key=ALICE, server=config, admin_key=None) as server:
        for method, path in (("POST", "/flush_cache"), ("POST", "/v1/cache/flush"),
                             ("GET", "/v1/cache")):  # fmt: skip
            response = httpx.request(method, server.url + path, headers=bearer(ALICE), timeout=30)
            assert response.status_code == 403, path
            assert response.json()["error"]["code"] == "admin_key_required"
        assert status(server, "GET", "/metrics", None) == 200  # Prometheus, no key set


def test_a_server_without_keys_keeps_its_cache_routes_open(model: Path) -> None:
    with live_server(model, server=ServerConfig(model_name="tiny")) as server:
        assert status(server, "POST", "/v1/cache/flush", None) == 200
        assert status(server, "GET", "/v1/cache", None) == 200


def test_without_a_derived_tenant_the_salt_is_the_tenant(model: Path) -> None:
    config = ServerConfig(salt_from="none", model_name="tiny", cache_page_text=True)
    with live_server(model, server=config) as server:
        for salt in ("red", "blue"):
            body = {"prompt": f"{salt} team notes", "max_tokens": 2, "cache_salt": salt}
            assert server.post("/v1/completions", json=body).status_code == 200
        server.wait_idle()
        red = server.get("/v1/cache/tree", params={"cache_salt": "red"}).json()
        text = "".join(n.get("text", "") for n in red["nodes"])
        assert "red team" in text and "blue" not in text
        unsalted = server.get("/v1/cache/tree").json()
        assert "red" not in str(unsalted) and "blue" not in str(unsalted)


def test_coarse_lengths_reach_tenants_nowhere_exactly(model: Path) -> None:
    config = ServerConfig(
        api_keys=(ALICE,), admin_key=ADMIN, report_cached_tokens="page", cached_tokens_page=16,
        model_name="tiny",
    )  # fmt: skip
    with live_server(model, api_key=ALICE, server=config) as server:
        for _ in range(2):
            answer = chat(server, ALICE, "Coarse lengths only.", return_cache_report=True)
            assert answer["cache_report"] is None  # a report places the miss to the token
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] % 16 == 0
        for path in ("/v1/cache/report", "/v1/cache/tree"):
            refused = httpx.get(server.url + path, headers=bearer(ALICE), timeout=30)
            assert refused.status_code == 403
            assert refused.json()["error"]["code"] == "lengths_not_reported"
            assert status(server, "GET", path, ADMIN) == 200  # the operator sees them exactly
        loads = httpx.get(server.url + "/v1/loads", headers=bearer(ALICE), timeout=30).json()
        load = loads["loads"][0]
        assert load["cache_hit_rate"] == 0.0 and load["num_cached_tokens"] % 16 == 0
        exact = httpx.get(server.url + "/v1/loads", headers=bearer(ADMIN), timeout=30).json()
        assert exact["loads"][0]["cache_hit_rate"] > 0
    open_metrics = ServerConfig(report_cached_tokens="none", model_name="tiny")
    with live_server(model, server=open_metrics) as server:
        server.post("/v1/completions", json={"prompt": "count me", "max_tokens": 1})
        metrics = server.get("/metrics").text
        assert "radixlm_prefix_cache_hit_tokens" not in metrics
        assert "radixlm_prefill_tokens" not in metrics and "radixlm_kv_slots" in metrics


def test_tenants_and_viewers_by_option() -> None:
    def request(headers: dict[str, str], admin: bool = False) -> Request:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        req = Request({"type": "http", "headers": raw, "state": {}})
        if admin:
            req.state.radixlm_admin = True
        return req

    keys = Tenancy(ServerConfig(api_keys=("k",)))
    assert keys.tenant_of("key:abc/team") == keys.tenant_of("key:abc") == "key:abc"
    assert keys.viewer(request({}), "ignored").tenant is None  # unauthenticated: no tenant
    assert keys.viewer(request({}, admin=True)).operator
    salts = Tenancy(ServerConfig(salt_from="none"))
    assert salts.tenant_of("a/b") == "a/b" and salts.tenant_of(None) is None
    assert salts.viewer(request({}), "a/b").tenant == "a/b"  # the salt names the tenant
    header = Tenancy(ServerConfig(salt_from="header:X-Org"))
    tenant = header.viewer(request({"X-Org": "acme"})).tenant
    assert tenant == header.tenant_of(header.namespace(request({"X-Org": "acme"}), "s"))
    with pytest.raises(ValueError, match="admin_key must differ"):
        ServerConfig(api_keys=("same",), admin_key="same")


def test_admin_key_and_header_timeout_from_flags(tmp_path: Path) -> None:
    key_file = tmp_path / "admin"
    key_file.write_text("# the operator's\nroot-from-file\n")
    args = ["serve", "--api-key", ALICE, "--admin-key-file", str(key_file),
            "--header-timeout-s", "2.5"]  # fmt: skip
    config = server_config(build_parser().parse_args(args))
    assert (config.admin_key, config.header_timeout_s) == ("root-from-file", 2.5)
    config = server_config(build_parser().parse_args(["serve", "--admin-key", "root"]))
    assert config.admin_key == "root" and config.api_keys == ()
