"""Frozen, self-validating configuration for each part of radixlm.

Each dataclass checks its values in `__post_init__` and raises `ValueError` naming the field, so
bad settings fail at construction, never deep inside the engine. The CLI is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CacheKind = Literal["radix", "none"]
Policy = Literal["lpm", "fcfs"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and where it runs. `path` None means the default model."""

    path: str | None = None
    dtype: DType = "float32"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = the cores available

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
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
    kv_dtype: DType | None = None  # None = the model's dtype

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.cache not in ("radix", "none"):
            raise ValueError(f"cache must be 'radix' or 'none', got {self.cache!r}")


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

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_batch_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")
        if self.policy not in ("lpm", "fcfs"):
            raise ValueError(f"policy must be 'lpm' or 'fcfs', got {self.policy!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server. The waiting-queue bound is SchedulerConfig's."""

    host: str = "127.0.0.1"  # loopback by default: exposing a server is a deliberate choice
    port: int = 8000
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer KEY`
    model_name: str | None = None  # the id /v1/models serves; None = from the model path
    worker_id: str | None = None  # this replica's name in x-radixlm-worker; None = host:port
    retry_after_s: int = 1  # the Retry-After of a 503 when the waiting queue is full
    graceful_shutdown_s: float = 3.0  # open streams get this long after Ctrl-C, then abort

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be non-empty")
        if not 0 <= self.port <= 65_535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
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
