"""Shared pytest fixtures (helpers live in tests/helpers.py). Nothing here downloads anything.

- `tiny_hf_model(variant)`: a tiny random Hugging Face model of one supported flag combination
  (helpers.TINY_VARIANTS), built once per session and variant into a temporary directory: the
  directory and the transformers model, the reference. `each_tiny_hf_model` runs a test once
  per variant.
- `make_engine(**options)`: a fresh Engine on the engine tests' model (built once per session).
- `server` / `client`: a live radixlm server per test module and an openai client on it that
  checks, after each test, that the slot accounting is back at idle. A module overrides
  `server_context_len` for a longer context.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from engine_helpers import new_engine, save_engine_model
from helpers import TINY_VARIANTS, TinyModel, save_tiny_model

if TYPE_CHECKING:
    import openai
    from live_server import LiveServer

    from radixlm.engine.engine import Engine

SERVER_API_KEY = "test-key"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread: tiny test models gain nothing from a second, and on a busy 2-core machine every
# 2-thread op waits for its straggler.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """tiny_hf_model(variant) -> TinyModel, built on first use and shared by the session."""
    built: dict[str, TinyModel] = {}

    def get(variant: str) -> TinyModel:
        if variant not in built:
            path = tmp_path_factory.mktemp(variant)
            built[variant] = TinyModel(variant, path, save_tiny_model(variant, path))
        return built[variant]

    return get


@pytest.fixture(params=list(TINY_VARIANTS))
def each_tiny_hf_model(
    request: pytest.FixtureRequest, tiny_hf_model: Callable[[str], TinyModel]
) -> TinyModel:
    """Parametrizes a test over every supported flag combination."""
    return tiny_hf_model(request.param)


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' model (engine_helpers.save_engine_model), saved once per session."""
    path = tmp_path_factory.mktemp("engine-model")
    save_engine_model(path)
    return path


@pytest.fixture(scope="session")
def make_engine(engine_model_dir: Path) -> Callable[..., Engine]:
    """make_engine(**options) -> a fresh Engine on the engine model (new_engine's options)."""

    def make(**options: Any) -> Engine:
        return new_engine(engine_model_dir, **options)

    return make


@pytest.fixture(scope="module")
def server_context_len() -> int:
    """The context length of the module's `server` model; a module overrides it to change it."""
    return 1024


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, server_context_len: int
) -> Iterator[LiveServer]:
    """A live server on a tiny chat model for the whole module; requests carry SERVER_API_KEY."""
    from live_server import live_server, save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), server_context_len)
    with live_server(model, api_key=SERVER_API_KEY) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    """An openai client on `server`; after the test, the server's accounting must be idle."""
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0) as c:
        yield c
    cache = server.wait_idle()
    assert cache["idle"] and cache["accounting_ok"] and cache["integrity"] == "ok", cache
