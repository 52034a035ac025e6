"""What every route of one app shares: the engine, the server config, the model's limits, metrics.

The limits (`ModelLimits`) are read once when the app is built. They are fixed at engine
construction (the model's context and vocabulary, the pool's size), so reading them outside the
engine thread is safe; everything that changes while serving is read through `AsyncEngine.call`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from radixlm.agents.chat import ChatAgents
from radixlm.config import ServerConfig
from radixlm.engine.async_engine import AsyncEngine
from radixlm.observatory.service import Observatory
from radixlm.server.bounds import ModelLimits, RequestBounds
from radixlm.server.generation import Generation
from radixlm.server.metrics import ServerMetrics
from radixlm.server.responses_api.store import ResponseStore
from radixlm.server.snapshot import SnapshotCache
from radixlm.server.tenancy import Tenancy

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    limits: ModelLimits
    bounds: RequestBounds  # length checks and the tokenizer threads
    tenancy: Tenancy  # API keys, tenants and namespaces, what lengths each caller is told
    snapshots: SnapshotCache  # /metrics' engine snapshots, shared by scrapes close together
    observatory: Observatory  # cache reports on request, per tenant (server/observatory_routes.py)
    agents: ChatAgents  # the prompt renderer, its turn memo and the grammars, for every route
    responses: ResponseStore  # the Responses API's stored responses, per namespace
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    generations: set[Generation] = field(default_factory=set)  # requests being served now

    @classmethod
    def build(cls, engine: AsyncEngine, config: ServerConfig) -> ServerState:
        core = engine.engine
        limits = ModelLimits(
            max_context_len=int(core.runner.max_context_len),
            num_slots=int(core.cache.capacity),
            vocab_size=int(core.runner.vocab_size),
        )
        metrics = ServerMetrics()
        tenancy = Tenancy(config)
        return cls(
            engine,
            config,
            config.model_name or served_name(core.model_config.path),
            limits,
            RequestBounds(core.tokenizer, limits, config),
            tenancy,
            SnapshotCache(config.metrics_snapshot_ttl_s),
            Observatory(engine, metrics, config.cache_page_text, tenancy.tenant_of),
            ChatAgents(core.tokenizer, limits.vocab_size),
            ResponseStore(config.max_stored_responses, config.max_stored_response_bytes),
            metrics,
        )

    def abort_all(self) -> None:
        """Abort every request being served (at shutdown): streams end, connections close.
        Non-blocking and safe from a signal handler."""
        for gen in list(self.generations):
            gen.abort()

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs, special tokens included (decode() would drop them)."""
        tokenizer = self.engine.tokenizer
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if hf is not None:
            return str(hf.decode([token_id], skip_special_tokens=False))
        return str(tokenizer.decode([token_id]))


def served_name(model_path: str | None) -> str:
    """The model id /v1/models reports: the file or directory name, without a GGUF suffix."""
    if model_path is None:
        return DEFAULT_MODEL_NAME
    name = Path(model_path.rstrip("/")).name
    return name.removesuffix(".gguf") or model_path
