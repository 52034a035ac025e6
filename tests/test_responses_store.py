"""Stored responses belong to the namespace that made them and are bounded: another tenant's id
answers exactly as an unknown id does, and no tenant can hold more than its share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.agents.turns import Turn
from radixlm.config import ServerConfig
from radixlm.server.responses_api.store import ResponseStore, StoredResponse

pytestmark = pytest.mark.timeout(120)

KEYS = ("key-a", "key-b")


def _stored(response_id: str, text: str = "x") -> StoredResponse:
    conversation = ({"role": "user", "content": text},)
    return StoredResponse(response_id, conversation, (Turn(text, (), (1, 2)),), {})


def test_each_namespace_keeps_its_own_and_at_most_its_share() -> None:
    store = ResponseStore(max_per_namespace=2, max_bytes=1 << 20)
    for i in range(3):
        assert store.put("a", _stored(f"resp_a{i}"))
    store.put("b", _stored("resp_b0"))
    assert store.get("a", "resp_a0") is None  # its least recently used went first
    assert store.get("a", "resp_a2") is not None and store.get("b", "resp_a2") is None
    assert store.get(None, "resp_b0") is None and store.get("b", "resp_b0") is not None
    assert len(store) == 3
    assert store.delete("a", "resp_a2") and not store.delete("a", "resp_a2")
    assert not store.delete("b", "resp_a1")  # not b's to delete


def test_the_byte_bound_drops_from_the_largest_namespace() -> None:
    small, big = _stored("resp_s", "s"), _stored("resp_big", "y" * 5000)
    store = ResponseStore(max_per_namespace=100, max_bytes=3 * big.num_bytes)
    store.put("quiet", small)
    for i in range(5):
        store.put("noisy", _stored(f"resp_n{i}", "y" * 5000))
        assert store.num_bytes <= store.max_bytes
    assert store.get("quiet", "resp_s") is not None  # the noisy tenant paid for itself
    assert store.get("noisy", "resp_n0") is None and store.get("noisy", "resp_n4") is not None
    assert not store.put("quiet", _stored("resp_huge", "z" * (4 * big.num_bytes)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-responses-store"), 1024)
    config = ServerConfig(api_keys=KEYS, model_name="tiny", salt_from="api-key")
    with live_server(model, api_key=KEYS[0], server=config) as live:
        yield live


def _as(server: LiveServer, key: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)


def test_another_tenants_response_is_an_unknown_id(server: LiveServer) -> None:
    body = {"input": "my secret plan", "max_output_tokens": 3}
    mine = _as(server, KEYS[0], "POST", "/v1/responses", json=body).json()
    rid, unknown = mine["id"], "resp_" + "0" * 32
    assert _as(server, KEYS[0], "GET", f"/v1/responses/{rid}").status_code == 200
    for path, param in ((f"/v1/responses/{rid}", "response_id"), ("/v1/responses", None)):
        if param is None:  # continue it
            theirs = _as(server, KEYS[1], "POST", path, json={
                "input": "go on", "previous_response_id": rid})  # fmt: skip
            never = _as(server, KEYS[1], "POST", path, json={
                "input": "go on", "previous_response_id": unknown})  # fmt: skip
        else:
            theirs = _as(server, KEYS[1], "GET", path)
            never = _as(server, KEYS[1], "GET", path.replace(rid, unknown))
        assert theirs.status_code == never.status_code == 404
        assert theirs.json() == _same_body(never.json(), unknown, rid)
    assert _as(server, KEYS[1], "DELETE", f"/v1/responses/{rid}").status_code == 404
    assert _as(server, KEYS[0], "GET", f"/v1/responses/{rid}").status_code == 200  # still there
    assert server.wait_idle()["idle"]


def _same_body(body: dict[str, Any], unknown: str, rid: str) -> dict[str, Any]:
    """`body` with the unknown id written as `rid`: the only difference allowed."""
    error = dict(body["error"])
    error["message"] = error["message"].replace(unknown, rid)
    return {"error": error}
