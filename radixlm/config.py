"""Frozen, self-validating configuration for each part of radixlm.

Each dataclass checks its values in `__post_init__` and raises `ValueError` naming the field, so
bad settings fail at construction, never deep inside the engine. The CLI is built from them. A
field of a fixed set of values is a `Literal` type, spelled once: its check and its CLI choices
read the values from the type (`typing.get_args`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

CacheKind = Literal["radix", "none"]
Eviction = Literal["lru", "turn-credit", "gdsf", "adaptive"]
Policy = Literal["lpm", "fcfs"]
DType = Literal["float32", "bfloat16", "float16"]
# The KV pool's: a float dtype, or "int8": codes with one bfloat16 scale per (token, kv head)
# row, about twice the tokens of bfloat16 in the same bytes (radixlm/cache/kv_quant.py).
KVDType = Literal["float32", "bfloat16", "float16", "int8"]
# "auto": the dtype this machine runs fastest, chosen when the model loads (ModelRunner):
# bfloat16 where the native kernels have bfloat16 dot products (AVX512-BF16), else float32.
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]
CachedTokensReport = Literal["exact", "page", "none"]
# What quantized weights (a GGUF file's blocks, or --quantize) become: kept as integer blocks
# for the quantized kernels, with int16 activations ("exact": greedy output as the float model
# on the dequantized weights) or int8 ("fast"); or "float", dequantized to the model's dtype.
QuantMode = Literal["exact", "fast", "float"]
Quantize = Literal["none", "q8_0"]
# Drafted tokens verified in the decode step (engine/speculate.py): "tree" drafts from the radix
# tree, the request's own tokens and its grammar on any backend; "auto" does so where verify rows
# keep a decode step's bits (greedy output identical with speculation on and off); "off" never.
Speculate = Literal["off", "tree", "auto"]


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and where it runs. `path` None means the default model."""

    path: str | None = None
    dtype: ModelDType = "auto"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = the cores available
    quant: QuantMode = "exact"
    quantize: Quantize = "none"  # a float checkpoint's linear weights quantized at load

    def __post_init__(self) -> None:
        _check_choice("quant", self.quant, QuantMode)
        _check_choice("quantize", self.quantize, Quantize)
        _check_choice("dtype", self.dtype, ModelDType)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV slot pool and the prefix cache over it."""

    num_slots: int = 65_536  # KV slots (tokens) in the pool
    page_size: int = 1  # matches and inserts cover whole pages of this many tokens
    cache: CacheKind = "radix"  # "none" never reuses KV (the ablation)
    kv_dtype: KVDType | None = None  # None = the model's dtype
    eviction: Eviction = "lru"  # which unlocked leaf goes first (radixlm/cache/eviction.py)
    l2_dir: str | None = None  # a directory for the L2 extent file; None = no L2 tier
    l2_capacity: int = 1 << 20  # tokens of KV the L2 extent file holds (64-token extents)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        _check_choice("cache", self.cache, CacheKind)
        if self.kv_dtype is not None:
            _check_choice("kv_dtype", self.kv_dtype, KVDType)
        if self.l2_capacity < 64:
            raise ValueError(f"l2_capacity must be >= 64 tokens, got {self.l2_capacity}")
        _check_choice("eviction", self.eviction, Eviction)


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and ordering of the step loop."""

    max_running_requests: int = 64
    # New tokens (prefill + decode) one forward may compute. A step of 512 takes ~0.4 s on two
    # CPU cores, which bounds how long running streams stall behind a prefill; raise it on
    # faster hardware or for offline throughput (`radixlm bench offline` uses 2048).
    max_batch_tokens: int = 512
    chunk_size: int = 512  # the longest prefill chunk of one request in one step
    policy: Policy = "lpm"
    max_waiting_requests: int = 4096  # a full waiting queue rejects new requests
    max_wait_steps: int = 256  # LPM age bound: a request waiting longer goes first
    speculate: Speculate = "auto"

    def __post_init__(self) -> None:
        if self.speculate not in ("off", "tree", "auto"):
            raise ValueError(f"speculate must be off, tree or auto, got {self.speculate!r}")
        for name in ("max_running_requests", "max_batch_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")
        _check_choice("policy", self.policy, Policy)


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server. The waiting-queue bound is SchedulerConfig's."""

    host: str = "127.0.0.1"  # loopback by default: exposing a server is a deliberate choice
    port: int = 8000
    # When non-empty, every /v1 route needs `Authorization: Bearer KEY` with one of these keys.
    api_keys: tuple[str, ...] = ()
    # The key of cache-wide routes (flush, server-wide statistics, every tenant's observatory);
    # never a tenant key (docs/security.md).
    admin_key: str | None = None
    model_name: str | None = None  # the id /v1/models serves; None = from the model path
    worker_id: str | None = None  # this replica's name in x-radixlm-worker; None = host:port
    retry_after_s: int = 1  # the Retry-After of a 503 when the waiting queue is full
    graceful_shutdown_s: float = 3.0  # open streams get this long after Ctrl-C, then abort
    # Where each request's cache namespace comes from (docs/security.md): "api-key" (one
    # namespace per key: tenants never share a cached prefix), "header:NAME", or "none".
    salt_from: str = "api-key"
    report_cached_tokens: CachedTokensReport = "exact"  # "page": rounded down; "none": omitted
    cached_tokens_page: int = 64  # the rounding unit of report_cached_tokens="page"
    max_body_bytes: int = 32 * 1024 * 1024  # a larger request body is a 413, read no further
    body_timeout_s: float = 30.0  # the whole body must arrive within this (else 408)
    body_idle_timeout_s: float = 10.0  # and no gap between two of its pieces may be longer
    header_timeout_s: float = 10.0  # a connection's request headers must arrive within this
    max_concurrent_tokenizations: int = 2  # prompts tokenized at once (threads)
    max_queued_tokenizations: int = 64  # more waiting than this is a 503
    metrics_snapshot_ttl_s: float = 1.0  # /metrics reuses an engine snapshot this young
    cache_page_text: bool = False  # /cache and /v1/cache/tree show token text (prompts: private)
    # The Responses API's stored responses (store + previous_response_id): at most this many per
    # cache namespace, and this many bytes (their text and token ids) in all; LRU dropped first
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be non-empty")
        if not 0 <= self.port <= 65_535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.api_keys, tuple) or not all(
            isinstance(k, str) and k and k == k.strip() and k.isprintable() for k in self.api_keys
        ):
            raise ValueError("api_keys must be a tuple of non-empty printable strings")
        if self.admin_key is not None and not (
            self.admin_key and self.admin_key == self.admin_key.strip()
            and self.admin_key.isprintable()
        ):  # fmt: skip
            raise ValueError("admin_key must be a non-empty printable string")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ValueError("admin_key must differ from every API key (tenant keys)")
        if self.model_name is not None and not self.model_name:
            raise ValueError("model_name must be non-empty when given")
        if self.worker_id is not None and not (
            self.worker_id.isprintable() and self.worker_id.isascii() and self.worker_id.strip()
        ):
            raise ValueError(f"worker_id must be non-empty printable ASCII, got {self.worker_id!r}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        header = self.salt_from.removeprefix("header:")
        if self.salt_from not in ("api-key", "none") and not (
            self.salt_from.startswith("header:") and _is_header_name(header)
        ):
            raise ValueError(
                f"salt_from must be 'api-key', 'header:NAME' or 'none', got {self.salt_from!r}"
            )
        _check_choice("report_cached_tokens", self.report_cached_tokens, CachedTokensReport)
        for name in ("cached_tokens_page", "max_body_bytes", "max_concurrent_tokenizations",
                     "max_stored_responses", "max_stored_response_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_tokenizations < 0:
            raise ValueError(
                f"max_queued_tokenizations must be >= 0, got {self.max_queued_tokenizations}"
            )
        for name in ("body_timeout_s", "body_idle_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.metrics_snapshot_ttl_s < 0:
            raise ValueError(
                f"metrics_snapshot_ttl_s must be >= 0, got {self.metrics_snapshot_ttl_s}"
            )


def _check_choice(name: str, value: object, choices: Any) -> None:
    """A ValueError naming field `name` when `value` is not one of the Literal type `choices`."""
    allowed = get_args(choices)
    if value not in allowed:
        *most, last = allowed
        raise ValueError(f"{name} must be {', '.join(most)} or {last}, got {value!r}")


def _is_header_name(name: str) -> bool:
    """An HTTP header name (RFC 9110 token characters)."""
    return bool(name) and all(c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in name)
