"""The cache side channel: `cached_tokens` told a client how much of its prompt another
client had sent. Keys get their own cache namespaces by default, a header can name the tenant,
and the server can round `cached_tokens` to pages or leave it out. Plus the key check itself:
several keys, a case-insensitive scheme, and no key in the startup banner.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model
from starlette.requests import Request

from radixlm.cli import build_parser
from radixlm.commands.options import server_config
from radixlm.commands.serve import _banner
from radixlm.config import ServerConfig
from radixlm.server.generation import Usage
from radixlm.server.tenancy import Tenancy

pytestmark = pytest.mark.timeout(120)

KEYS = ("alice-key", "bob-key")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tenancy"), context_len=512)


@pytest.fixture(scope="module")
def keyed(model: Path) -> Iterator[LiveServer]:
    config = ServerConfig(api_keys=KEYS, model_name="tiny")
    with live_server(model, api_key=KEYS[0], server=config) as live:
        yield live


def _cached(server: LiveServer, prompt: str, headers: dict[str, str], **body: Any) -> int:
    response = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, **body},
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _secret_prompt() -> str:
    return f"the PIN of {uuid.uuid4().hex} is 4821, do not tell anyone about it"


def test_each_key_gets_its_own_cache_namespace(keyed: LiveServer) -> None:
    alice = {"Authorization": "Bearer alice-key"}
    bob = {"Authorization": "Bearer bob-key"}
    secret = _secret_prompt()
    assert _cached(keyed, secret, alice) == 0
    assert _cached(keyed, secret, alice) > 30  # her own prefix: a hit
    assert _cached(keyed, secret, bob) == 0  # the probe sees nothing
    assert _cached(keyed, secret, bob, cache_salt="x") == 0  # nor with any salt of its own
    assert _cached(keyed, secret, alice, cache_salt="x") == 0  # a salt subdivides her namespace
    assert keyed.wait_idle()["idle"]


def test_the_bearer_scheme_is_case_insensitive(keyed: LiveServer) -> None:
    def status(authorization: str) -> int:
        headers = {"Authorization": authorization}
        return httpx.get(keyed.url + "/v1/models", headers=headers, timeout=30).status_code

    assert status("bearer alice-key") == 200
    assert status("BEARER  bob-key") == 200
    assert status("Bearer carol-key") == 401
    assert status("Basic alice-key") == 401
    assert status("alice-key") == 401


def test_a_header_names_the_tenant_and_cached_tokens_are_rounded(model: Path) -> None:
    config = ServerConfig(
        salt_from="header:X-Tenant", report_cached_tokens="page", cached_tokens_page=16
    )
    with live_server(model, server=config) as server:
        secret = _secret_prompt()
        missing = server.post("/v1/completions", json={"prompt": secret, "max_tokens": 1})
        assert missing.status_code == 400 and "x-tenant" in missing.json()["error"]["message"]
        a, b = {"X-Tenant": "a"}, {"X-Tenant": "b"}
        assert _cached(server, secret, a) == 0
        hit = _cached(server, secret, a)
        assert hit > 0 and hit % 16 == 0
        assert _cached(server, secret, b) == 0
        assert server.wait_idle()["idle"]


def test_cached_tokens_can_be_left_out(model: Path) -> None:
    with live_server(model, server=ServerConfig(report_cached_tokens="none")) as server:
        body = {"prompt": _secret_prompt(), "max_tokens": 1}
        for _ in range(2):
            usage = server.post("/v1/completions", json=body).json()["usage"]
            assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = server.post("/v1/completions", json=stream).text
        assert '"usage":{"prompt_tokens"' in events and "cached_tokens" not in events
        assert server.wait_idle()["idle"]


def test_namespaces_and_reports_by_option() -> None:
    def request(headers: dict[str, str]) -> Request:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return Request({"type": "http", "headers": raw, "state": {}})

    none = Tenancy(ServerConfig(salt_from="none"))
    assert none.namespace(request({}), None) is None
    assert none.namespace(request({}), "mine") == "mine"
    header = Tenancy(ServerConfig(salt_from="header:X-Org"))
    one = header.namespace(request({"X-Org": "acme"}), None)
    assert one and "acme" not in one  # a digest, not the tenant's name
    assert header.namespace(request({"X-Org": "acme"}), "s") == f"{one}/s"
    assert header.namespace(request({"X-Org": "other"}), None) != one
    usage = Usage(prompt_tokens=100, completion_tokens=1, cached_tokens=77)
    assert Tenancy(ServerConfig()).reported(usage).cached_tokens == 77
    paged = Tenancy(ServerConfig(report_cached_tokens="page", cached_tokens_page=32))
    assert paged.reported(usage).cached_tokens == 64
    hidden = Tenancy(ServerConfig(report_cached_tokens="none")).reported(usage)
    assert "prompt_tokens_details" not in hidden.to_dict()
    with pytest.raises(ValueError, match="salt_from"):
        ServerConfig(salt_from="header:")
    with pytest.raises(ValueError, match="report_cached_tokens"):
        ServerConfig(report_cached_tokens="rounded")  # type: ignore[arg-type]  # the bad value under test


def test_keys_from_flags_and_a_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nalice-key\n\ncarol-key\n")
    argv = ["serve", "--api-key", "bob-key", "--api-key-file", str(keys_file)]
    config = server_config(build_parser().parse_args(argv))
    assert config.api_keys == ("bob-key", "alice-key", "carol-key")
    assert config.salt_from == "api-key"
    argv = ["serve", "--salt-from", "header:X-Tenant", "--report-cached-tokens", "page"]
    config = server_config(build_parser().parse_args(argv))
    assert (config.salt_from, config.report_cached_tokens, config.api_keys) == (
        "header:X-Tenant",
        "page",
        (),
    )
    with pytest.raises(ValueError, match="api-key-file"):
        server_config(build_parser().parse_args(["serve", "--api-key-file", str(tmp_path)]))


def test_the_banner_never_prints_a_key() -> None:
    banner = _banner(ServerConfig(api_keys=("sk-very-secret",)), "tiny")
    assert "sk-very-secret" not in banner
    assert "Authorization: Bearer $RADIXLM_API_KEY" in banner


def test_help_states_each_default_once() -> None:
    parser = build_parser()
    for command in ("serve", "chat", "generate"):
        # argparse keeps its subcommands in private fields typed for any action
        sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr,index]
        for action in sub._actions:
            assert (action.help or "").count("(default:") <= 1, (command, action.help)
