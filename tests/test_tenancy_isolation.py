"""Tenants stay apart in every surface. Two worlds differ only in a secret that tenant A put in
its prompts; in each, tenant B probes every observable a client can reach (usage, cache reports
on chat, completions and streams, the report ring, the tree and its text, the /cache page,
/v1/loads, /server_info, /metrics and its labels, the cache-wide routes), with a guess that is
A's prompt in the first world, before and after the operator flushes the cache. Everything B
observes, timing aside (docs/security.md), must be the same in both worlds; A's own probe, the
control, tells the worlds apart.

Run with tenants from API keys (with an admin key) and from a proxy's header (without one, so
/metrics is open to B).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import sse_events
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.config import ServerConfig
from radixlm.engine.engine import Engine
from radixlm.server.snapshot import flush_cache, take_snapshot

pytestmark = pytest.mark.timeout(300)

PINS = ("4821", "7390")  # the secret of each world: same length, same number of tokens
GUESS = PINS[0]  # B guesses the first world's secret exactly


def memo(pin: str) -> str:
    """A's secret prompt; the PIN within the first tokens of every edge that starts it, where a
    tree picture with text would show it."""
    return f"PIN {pin}. Internal memo for staff: never reveal the vault PIN to anyone."


@dataclass(frozen=True)
class Tenant:
    headers: dict[str, str]


@dataclass(frozen=True)
class Setup:
    config: ServerConfig
    a: Tenant
    b: Tenant


SETUPS = {
    "keys": Setup(
        ServerConfig(
            api_keys=("alice-key", "bob-key"), admin_key="root-key", model_name="tiny",
            cache_page_text=True,
        ),
        Tenant({"Authorization": "Bearer alice-key"}),
        Tenant({"Authorization": "Bearer bob-key"}),
    ),
    "header": Setup(
        ServerConfig(salt_from="header:X-Tenant", model_name="tiny", cache_page_text=True),
        Tenant({"X-Tenant": "alice"}),
        Tenant({"X-Tenant": "bob"}),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tenancy-worlds"), context_len=512)


def world(model: Path, setup: Setup, pin: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh server; A sends its secret; then what B observes and what A's own probe sees."""
    with live_server(model, server=setup.config, admin_key=None) as server:
        victim(server, setup.a, pin)
        seen = probe(server, setup.b)
        control = chat(server, setup.a, memo(GUESS))["usage"]
        operator(server, flush_cache)  # the operator flushes: every unlocked node is evicted
        # A completion of A's very prompt, which B never sent: no evicted record to find
        seen["after flush, completion"] = complete(server, setup.b, memo(GUESS))
        seen["after flush"] = probe_once(server, setup.b)
        snapshot = operator(server, take_snapshot)
        assert snapshot.idle and snapshot.accounting_ok, snapshot
        operator(server, lambda e: e.cache.check_integrity())
    return seen, control


@pytest.mark.parametrize("name", list(SETUPS))
def test_nothing_tenant_b_observes_depends_on_tenant_a_s_secret(model: Path, name: str) -> None:
    setup = SETUPS[name]
    (first, control_first), (second, control_second) = (world(model, setup, p) for p in PINS)
    for key in first:
        assert first[key] == second[key], f"{name}: {key} depends on A's secret"
    # The control: A's own namespace answers the same guess differently in the two worlds.
    assert (
        control_first["prompt_tokens_details"]["cached_tokens"]
        > (control_second["prompt_tokens_details"]["cached_tokens"])
    )
    # And B's probe was seen by B as new content in its own namespace, never as another's.
    report = first["chat"]["cache_report"]
    assert report["reason"] == "new_content" and report["cached_len"] == 0, report
    assert first["after flush"]["cache_report"]["reason"] == "evicted"  # B's own, evicted
    assert first["after flush, completion"]["cache_report"]["reason"] == "new_content"


def victim(server: LiveServer, a: Tenant, pin: str) -> None:
    """A's traffic: a chat twice (a hit), the same under a salt of its own, a completion."""
    for extra in ({}, {}, {"cache_salt": "team"}):
        chat(server, a, memo(pin), **extra)
    complete(server, a, memo(pin))


def probe(server: LiveServer, b: Tenant) -> dict[str, Any]:
    """Every observable B can reach, normalised (ids and clocks out)."""
    seen: dict[str, Any] = {"chat": probe_once(server, b)}
    seen["chat, own salt"] = chat(server, b, memo(GUESS), cache_salt="team")
    # (completions probe the guess inside other text: B's first completion of A's exact prompt
    # comes after the flush, where an evicted record of A's would show)
    seen["completion"] = complete(server, b, "Note: " + memo(GUESS))
    seen["completion, prefix"] = complete(server, b, "Note: " + memo(GUESS)[:30])
    stream = server.post(
        "/v1/completions",
        headers=b.headers,
        json={**_sampling(), "prompt": "Note: " + memo(GUESS), "stream": True,
              "stream_options": {"include_usage": True}, "return_cache_report": True},
    )  # fmt: skip
    seen["stream"] = [_normal(e) for e in sse_events(stream.text)]
    for path in ("/v1/cache/report", "/v1/cache/tree", "/cache", "/v1/loads", "/server_info",
                 "/metrics", "/v1/cache", "/v1/cache?check_integrity=true"):  # fmt: skip
        seen[path] = _answer(server.get(path, headers=b.headers))
    for path in ("/v1/cache/flush", "/flush_cache"):
        seen[path] = _answer(server.post(path, headers=b.headers))
    return seen


def probe_once(server: LiveServer, b: Tenant) -> dict[str, Any]:
    return chat(server, b, memo(GUESS))


def chat(server: LiveServer, tenant: Tenant, system: str, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "What is the PIN?"}],
            "return_cache_report": True, **_sampling(), **extra}  # fmt: skip
    return _request(server, "/v1/chat/completions", tenant, body)


def complete(server: LiveServer, tenant: Tenant, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "return_cache_report": True, **_sampling()}
    return _request(server, "/v1/completions", tenant, body)


def operator(server: LiveServer, fn: Any) -> Any:
    """fn(engine) in the engine thread, as the operator's tools would run it."""

    def run(engine: Engine) -> Any:
        return fn(engine)

    return asyncio.run(server.engine.call(run))


# ---- helpers --------------------------------------------------------------------------------
def _sampling() -> dict[str, Any]:
    return {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _request(server: LiveServer, path: str, tenant: Tenant, body: dict[str, Any]) -> Any:
    response = server.post(path, headers=tenant.headers, json=body)
    assert response.status_code == 200, response.text
    _settle(server)
    return _normal(response.json())


def _settle(server: LiveServer) -> None:
    """Until no request holds a slot (a finished request's slots come back asynchronously)."""
    for _ in range(400):
        if operator(server, take_snapshot).idle:
            return
        time.sleep(0.02)
    raise AssertionError("the server did not settle")


def _answer(response: Any) -> Any:
    """A route's status and body, normalised; /metrics without its clocks and latencies."""
    text = response.text
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.status_code, _normal(response.json())
    if "text/plain" in response.headers.get("content-type", "") and "# HELP" in text:
        return response.status_code, _metrics(text)
    return response.status_code, text


_CLOCKS = {"id", "created", "timestamp", "at", "system_fingerprint"}
_LATENCIES = re.compile(
    r"time_to_first_token|inter_token_latency|request_stage_seconds|engine_(forward|step)_seconds"
    r"|_created\b|_created\{"
)


def _metrics(text: str) -> list[str]:
    """Prometheus text without timestamps (`*_created`) and latency histograms (timing is the
    channel docs/security.md covers)."""
    return [line for line in text.splitlines() if not _LATENCIES.search(line)]


def _normal(value: Any) -> Any:
    """JSON with response ids and wall-clock times dropped, eviction times as present or not."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in _CLOCKS:
                continue
            out[k] = (v is not None) if k == "evicted_at" else _normal(v)
        return out
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def test_normalising_keeps_what_depends_on_content() -> None:
    """The comparison drops clocks only: a changed count or text still shows."""
    body = {"id": "x", "created": 1, "usage": {"cached_tokens": 5}, "text": "PIN 4821"}
    assert _normal(body) == {"usage": {"cached_tokens": 5}, "text": "PIN 4821"}
    assert _normal(json.loads('{"evicted_at": 12.5}')) == {"evicted_at": True}
    assert _metrics("a_created 17\nradixlm_prefix_cache_hit_tokens 40.0") == [
        "radixlm_prefix_cache_hit_tokens 40.0"
    ]
