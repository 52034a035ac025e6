"""A real radixlm server for tests: a tiny random Llama, the engine thread, uvicorn on 127.0.0.1.

    model = save_tiny_chat_model(tmp_path)           # config + safetensors + byte-level tokenizer
    with live_server(model, api_key="k") as server:  # a free port, torn down on exit
        OpenAI(base_url=server.url + "/v1", api_key="k")...
        server.wait_idle()                           # /v1/cache once no request holds a slot

A multi-tenant server (API keys, or header tenants) gets an admin key (`admin_key`, by default
TEST_ADMIN_KEY, unless its config names one; None leaves it without), and the LiveServer sends
it on the cache-wide routes (OPERATOR_PATHS), as an operator would; every other request carries
the tenant key `api_key`.

`RecordingHandler` keeps the log records a server writes, for tests of what it logs.

Nothing is downloaded: the tokenizer is 256 byte tokens (byte b is token b) plus ChatML specials,
built in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from starlette.types import ASGIApp

from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from radixlm.engine.async_engine import AsyncEngine
from radixlm.engine.engine import Engine
from radixlm.server.app import create_app
from radixlm.server.connections import header_timeout_protocol

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEST_ADMIN_KEY = "test-admin-key"
OPERATOR_PATHS = frozenset({"/v1/cache", "/v1/cache/flush", "/flush_cache", "/metrics"})


def save_tiny_chat_model(
    path: Path, context_len: int = 1024, hidden: int = 64, num_layers: int = 2, seed: int = 0
) -> Path:
    """A small random Llama (GQA) with a byte-level ChatML tokenizer, saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {ch: byte for byte, ch in _byte_to_char().items()}  # byte b is token b
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIALS)})
    rust = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=rust, eos_token="<|endoftext|>", chat_template=CHATML
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    config = LlamaConfig(
        vocab_size=264,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_len,
        bos_token_id=None,
        eos_token_id=256,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # O(1) logits, so sampling is not a near-uniform coin toss
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return chars


@dataclass
class LiveServer:
    url: str
    api_key: str | None
    engine: AsyncEngine
    admin_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def headers_for(self, path: str) -> dict[str, str]:
        """The admin key on the cache-wide routes (when the server has one), else the tenant's."""
        if self.admin_key and path in OPERATOR_PATHS:
            return {"Authorization": f"Bearer {self.admin_key}"}
        return self.headers

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 60)
        headers = {**self.headers_for(path), **kwargs.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 60)
        headers = {**self.headers_for(path), **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, **kwargs)

    def cache(self) -> dict[str, Any]:
        response = self.get("/v1/cache", params={"check_integrity": "true"})
        response.raise_for_status()
        return dict(response.json())

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """/v1/cache once no request holds a slot (aborts land asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            cache = self.cache()
            if cache["idle"] or time.monotonic() > deadline:
                return cache
            time.sleep(0.05)


@contextmanager
def live_server(
    model_path: Path,
    *,
    api_key: str | None = None,
    cache: CacheConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    server: ServerConfig | None = None,
    admin_key: str | None = TEST_ADMIN_KEY,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
) -> Iterator[LiveServer]:
    """A server on a free port; `server` overrides the ServerConfig (its api_keys win over
    `api_key`, which is the one key the LiveServer's requests carry); `wrap` wraps the app (a
    test's own middleware, outermost)."""
    async_engine = AsyncEngine(
        lambda: Engine(
            ModelConfig(path=str(model_path), dtype="float32", num_threads=1),
            cache or CacheConfig(num_slots=8192),
            scheduler or SchedulerConfig(max_running_requests=16, max_batch_tokens=1024),
        )
    )
    async_engine.start()
    keys = (api_key,) if api_key else ()
    config = _with_admin_key(server or ServerConfig(api_keys=keys, model_name="tiny"), admin_key)
    app: ASGIApp = create_app(async_engine, config)
    if wrap is not None:
        app = wrap(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held from now on: no race with other tests
    port = sock.getsockname()[1]
    http = header_timeout_protocol(config.header_timeout_s)  # as `radixlm serve` runs it
    uv = uvicorn.Server(
        uvicorn.Config(app, http=http, log_level="warning", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        yield LiveServer(f"http://127.0.0.1:{port}", api_key, async_engine, config.admin_key)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        async_engine.shutdown()
        sock.close()


def _with_admin_key(config: ServerConfig, admin_key: str | None) -> ServerConfig:
    """`config`, with `admin_key` when it is multi-tenant and names none."""
    multi_tenant = bool(config.api_keys) or config.salt_from.startswith("header:")
    if config.admin_key is None and multi_tenant and admin_key is not None:
        return dataclasses.replace(config, admin_key=admin_key)
    return config


class RecordingHandler(logging.Handler):
    """A logging handler that keeps every record it handles, in order (`records`)."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
