"""The routes a gateway (smg) calls on a replica: /v1/loads, /flush_cache, /server_info, and the
x-radixlm-worker header naming the replica on every response."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.config import ServerConfig
from radixlm.server.snapshot import EngineSnapshot
from radixlm.server.worker_routes import (
    WORKER_HEADER,
    WorkerHeaderMiddleware,
    loads_body,
    worker_id,
)

pytestmark = pytest.mark.timeout(120)

LOAD_KEYS = {
    "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
    "max_total_num_tokens", "token_usage", "cache_hit_rate",
}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("worker_model"), context_len=512)


def _complete(server: LiveServer, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    response = server.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_loads_count_only_what_requests_hold(model: Path) -> None:
    fresh = ServerConfig(model_name="tiny", metrics_snapshot_ttl_s=0.0)  # no reused snapshot
    with live_server(model, server=fresh) as server:
        idle = server.get("/v1/loads").json()
        assert set(idle) >= {"timestamp", "dp_rank_count", "loads"}
        assert idle["dp_rank_count"] == 1 and len(idle["loads"]) == 1
        load = idle["loads"][0]
        assert set(load) >= LOAD_KEYS
        assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == 8192
        assert load["num_used_tokens"] == 0 and load["token_usage"] == 0.0

        prompt = "a shared system prompt that the second request reuses. " * 4
        _complete(server, prompt + "first")
        _complete(server, prompt + "second")
        cache = server.wait_idle()
        assert cache["num_tree_tokens"] > 200  # both sequences stay warm in the tree ...
        load = server.get("/v1/loads").json()["loads"][0]
        assert load["num_used_tokens"] == 0  # ... and count as free capacity
        assert load["token_usage"] == 0.0
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        assert load["num_cached_tokens"] == cache["num_tree_tokens"]
        expected_rate = (
            cache["engine_stats"]["cached_prompt_tokens"] / cache["engine_stats"]["prompt_tokens"]
        )
        assert load["cache_hit_rate"] == pytest.approx(expected_rate)
        assert load["cache_hit_rate"] > 0.3  # the second prompt found the first one's prefix


def test_loads_used_is_in_flight_plus_locked_slots() -> None:
    snapshot = EngineSnapshot(
        capacity=1000, num_free=500, num_tree_tokens=450, num_evictable=400, num_protected=50,
        num_in_flight=50, num_waiting=3, num_running=2, num_unfinished=5,
        engine_stats={"prompt_tokens": 400, "cached_prompt_tokens": 100}, cache_stats={},
    )  # fmt: skip
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    body = loads_body(snapshot, max_running_requests=64, now=now)
    load = body["loads"][0]
    assert body["timestamp"] == "2026-12-01T12:00:00+00:00"  # smg reads a string
    assert load["max_running_requests"] == 64
    assert load["num_used_tokens"] == 100  # 50 in flight + 50 locked; 400 evictable are free
    assert load["token_usage"] == pytest.approx(0.1)
    assert load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 3
    assert load["cache_hit_rate"] == pytest.approx(0.25)


def test_flush_cache_alias_and_server_info(model: Path) -> None:
    with live_server(model) as server:
        _complete(server, "fill the tree with something " * 3)
        assert server.wait_idle()["num_tree_tokens"] > 0
        flushed = server.post("/flush_cache")
        assert flushed.status_code == 200
        assert flushed.json()["flushed_tokens"] > 0
        cache = server.wait_idle()
        assert cache["num_tree_tokens"] == 0 and cache["accounting_ok"]

        info = server.get("/server_info").json()
        assert info["model"] == "tiny" and info["version"]
        assert info["context_length"] == 512 and info["num_slots"] == 8192
        assert info["max_total_num_tokens"] == 8192
        assert info["worker_id"] == "127.0.0.1:8000"  # the config's host:port by default
        # smg takes a worker that answers /version for vLLM
        assert server.get("/version").status_code == 404


def test_worker_routes_follow_the_api_key(model: Path) -> None:
    """/v1/loads and /server_info take the tenant key; /flush_cache is cache-wide and takes
    the admin key only."""
    with live_server(model, api_key="secret") as server:
        for path in ("/v1/loads", "/server_info"):
            assert server.get(path).status_code == 200, path  # with the tenant key
            refused = httpx.get(server.url + path, timeout=30)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
        tenant = httpx.post(server.url + "/flush_cache", headers=server.headers, timeout=30)
        assert tenant.status_code == 401 and "admin key" in tenant.json()["error"]["message"]
        assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 401
        assert server.post("/flush_cache").status_code == 200  # the admin key
        # liveness stays open, and every response names the replica
        server.api_key = None
        health = server.get("/health")
        assert health.status_code == 200 and health.headers[WORKER_HEADER] == "127.0.0.1:8000"


def test_every_response_names_the_worker(model: Path) -> None:
    with live_server(model) as server:
        response = server.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 3, "stream": True},
        )  # fmt: skip
        assert response.status_code == 200
        assert response.headers[WORKER_HEADER] == "127.0.0.1:8000"
        assert server.get("/no/such/route").headers[WORKER_HEADER] == "127.0.0.1:8000"


def test_worker_id_from_config() -> None:
    assert worker_id(ServerConfig(host="0.0.0.0", port=8001)) == "0.0.0.0:8001"
    assert worker_id(ServerConfig(worker_id="box-a/1")) == "box-a/1"
    with pytest.raises(ValueError, match="worker_id"):
        ServerConfig(worker_id=" ")
    app = FastAPI()
    app.get("/x")(lambda: {"ok": True})
    app.add_middleware(WorkerHeaderMiddleware, worker="box-a/1")
    assert TestClient(app).get("/x").headers[WORKER_HEADER] == "box-a/1"
