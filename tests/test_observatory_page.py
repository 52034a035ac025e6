"""The live tree page: /cache serves the page (public, without data), /v1/cache/tree the tree as
a bounded JSON picture that aggregates small subtrees (behind the API key), and in a headless
chromium (when one is installed) the page draws the tree and redraws it after more requests,
and with keys set, draws only once it was given the key."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model

from radixlm.cache.radix_tree import RadixTree
from radixlm.config import ServerConfig
from radixlm.observatory.tree_view import tree_picture

API_KEY = "test-key"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    config = ServerConfig(api_keys=(API_KEY,), cache_page_text=True)
    with live_server(model, api_key=API_KEY, server=config) as live:
        yield live


def chat(server: LiveServer, system: str, user: str) -> None:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    response = server.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_page_is_public_and_its_data_needs_the_key(server: LiveServer) -> None:
    chat(server, "Private system prompt.", "question")
    page = httpx_get(server, "/cache", key=False)  # a browser opening the page: no header
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "Private" not in page.text and "Authorization" in page.text
    assert "?key=" not in page.text  # the key never travels in a query string
    for path in ("/v1/cache/tree", "/v1/cache/report"):
        refused = httpx_get(server, path, key=False)
        assert refused.status_code == 401 and "nodes" not in refused.text
        assert httpx_get(server, path).status_code == 200


def test_page_and_tree_json(server: LiveServer) -> None:
    server.post("/v1/cache/flush").raise_for_status()
    page = server.get("/cache")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/cache/tree" in page.text and "<script>" in page.text
    assert "<script src" not in page.text and "https://" not in page.text  # no CDN: all inline
    for user in ("first question", "second question"):
        chat(server, "Shared system prompt.", user)
    server.wait_idle()
    tree = server.get("/v1/cache/tree").json()
    nodes = tree["nodes"]
    assert tree["num_tokens"] == sum(n["tokens"] for n in nodes) > 0
    roots = [n for n in nodes if n["parent"] is None]
    assert len(roots) == 1 and roots[0]["tokens"] == 0
    trunk = [n for n in nodes if n["parent"] == roots[0]["id"]]
    assert len(trunk) == 1 and trunk[0]["text"].startswith("<|im_start|>system\nShared")
    branches = [n for n in nodes if n["parent"] == trunk[0]["id"]]
    assert sorted(b["text"][:6] for b in branches) == ["first ", "second"]
    leaves = [n for n in nodes if n["leaf"]]  # idle: nothing locked, every leaf evictable
    assert len(leaves) == 2 and all(n["evictable"] and n["lock_ref"] == 0 for n in leaves)
    assert all(n["lock_ref"] == 0 for n in nodes)
    assert sum(n["next_evicted"] for n in nodes) == 2


def test_big_tree_is_aggregated() -> None:
    """100k nodes under one trunk: the picture stays at its bound, the rest is aggregates."""
    tree = RadixTree()
    rng = np.random.default_rng(0)
    trunk = list(range(1000, 1100))
    for i in range(100_000):
        tokens = [*trunk, int(rng.integers(0, 50_000)), i % 7, i]
        tree.insert(tokens, np.arange(len(tokens)))
    picture = tree_picture(tree, max_nodes=300)
    nodes = picture["nodes"]
    assert picture["num_nodes"] > 50_000 and len(nodes) <= 2 * 300
    hidden = [n for n in nodes if n.get("aggregate")]
    assert hidden and sum(n["count"] for n in hidden) > 40_000
    assert "head" not in nodes[1]  # token ids only when asked


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium not installed")
def test_page_draws_and_updates_in_chromium(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A server without keys: a browser cannot add a Bearer header to the page's own load."""
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-open"))
    with live_server(model) as server:
        chat(server, "Browser test prompt.", "one")
        server.wait_idle()
        first = dump_dom(server)
        assert 'data-updates="' in first and first.count("<rect") == shown(first) > 1
        for user in ("two", "three", "four"):
            chat(server, "Browser test prompt, another branch.", user)
        server.wait_idle()
        again = dump_dom(server)
        assert again.count("<rect") == shown(again) > shown(first)
        assert "Browser test prompt" not in again  # token text only with cache_page_text


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium not installed")
def test_page_sends_the_key_it_is_given(server: LiveServer) -> None:
    """With keys set: opened bare, the page asks for the key and draws nothing; opened as
    /cache#key=KEY, its script sends the key and draws the tree."""
    chat(server, "Keyed browser prompt.", "one")
    server.wait_idle()
    bare = dump_dom(server)
    assert 'data-auth="needed"' in bare and "<rect" not in bare
    assert '<form id="auth">' in bare  # the key field is shown (no longer hidden)
    keyed = dump_dom(server, f"#key={API_KEY}")
    assert 'data-auth="ok"' in keyed and keyed.count("<rect") == shown(keyed) > 1
    assert "&lt;|im_start|&gt;system" in keyed  # the tree's text (cache_page_text)


def dump_dom(server: LiveServer, fragment: str = "") -> str:
    """The page's DOM after its script ran (virtual time: the first poll and its redraw)."""
    out = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
         "--dump-dom", f"{server.url}/cache{fragment}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout


def shown(dom: str) -> int:
    """How many nodes the page says it drew (its body's data-shown)."""
    return int(dom.split('data-shown="')[1].split('"')[0])


def httpx_get(server: LiveServer, path: str, key: bool = True) -> Any:
    import httpx

    return httpx.get(server.url + path, headers=server.headers if key else {}, timeout=30)
