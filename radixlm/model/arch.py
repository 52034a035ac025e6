"""ArchConfig: the shape and flags of one Llama-family decoder, read from a Hugging Face config.

Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 differ only in a few switches (biases, q/k norm,
rope scaling, tied embeddings), so one decoder serves them all. `ArchConfig.from_hf` reads a
`config.json` dict (the GGUF loader first turns GGUF metadata into such a dict) and refuses,
with a ValueError naming the reason, anything the decoder would compute wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RopeKind = Literal["default", "linear", "llama3"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies: base `theta`, optionally rescaled (linear or llama3)."""

    theta: float = 10_000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only: the pretraining context

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ArchConfig:
    """Everything the decoder and the KV pool need to know about a model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_len: int  # max_position_embeddings: the longest sequence the model accepts
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias` also puts one on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {self.max_context_len}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ArchConfig:
        """Read a Hugging Face `config.json` (transformers 4.x or 5.x field names)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r} (architectures "
                f"{cfg.get('architectures')}); radixlm runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse_sliding_window(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) unsupported")
        num_heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            max_context_len=int(cfg["max_position_embeddings"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
        )


def _refuse_sliding_window(cfg: Mapping[str, Any]) -> None:
    """Full attention only: refuse a config whose attention is windowed within its context."""
    window = cfg.get("sliding_window")
    if cfg["model_type"] in ("qwen2", "qwen3"):
        windowed = bool(cfg.get("use_sliding_window", False)) and window is not None
    else:
        windowed = window is not None and int(window) < int(cfg["max_position_embeddings"])
    layer_types = cfg.get("layer_types") or []
    if windowed or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{cfg['model_type']} config uses sliding-window attention (sliding_window={window}); "
            "radixlm supports full attention only for now"
        )


def _rope_config(cfg: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope scaling {kind!r}; radixlm supports default, linear, llama3")


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
