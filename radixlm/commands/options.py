"""Command-line options built from the config dataclasses, shared by every command.

Each field of a frozen config becomes one flag (`num_slots` -> `--num-slots`), typed, with the
choices of a `Literal` and the dataclass default in its help; a flag left out keeps that default.
Reading the flags back goes through the dataclass, so its `__post_init__` validates them.

    add_engine_arguments(parser)        # --model, --dtype, --num-slots, --policy, ...
    configs = engine_configs(args)      # EngineConfigs(model, cache, scheduler); ValueError if bad
    engine = load_engine(configs)       # with a progress display while the model loads
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

from radixlm.api_types import SamplingParams
from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig

C = TypeVar("C")

# Field -> flag renames (the rest are the field name with dashes).
_FLAGS = {"path": "model", "cache": "cache"}

_HELP = {
    "path": "a GGUF file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)",
    "dtype": "weights and activations; auto: bfloat16 where the CPU has AVX512-BF16 dot "
    "products, else float32 (docs/kernels.md)",
    "device": "cpu or cuda[:N]",
    "quant": "quantized weights (GGUF blocks, --quantize): exact keeps them as integer blocks "
    "with int16 activations (greedy output as on the dequantized weights); fast with int8 "
    "activations (llama.cpp's numerics); float dequantizes them (docs/kernels.md)",
    "quantize": "quantize a float checkpoint's linear weights at load (q8_0: int8 per 32)",
    "num_threads": "torch threads (default: the cores available)",
    "num_slots": "KV slots (tokens) in the pool",
    "page_size": "tokens per page of the prefix cache",
    "cache": "radix reuses cached prefixes; none is the ablation",
    "kv_dtype": "the KV pool's dtype (default: the model's); int8 holds about twice the tokens "
    "of bfloat16 in the same memory (a scale per token and head; docs/kernels.md)",
    "eviction": "lru; turn-credit (later turns live longer); gdsf (costlier prefixes live "
    "longer); adaptive (learns online which order to follow); docs/cache.md",
    "l2_dir": "a directory for the L2 extent file (KV on disk under the tree; default: none)",
    "l2_capacity": "tokens of KV the L2 extent file holds",
    "max_running_requests": "requests decoding together",
    "max_batch_tokens": "tokens one forward pass may compute",
    "chunk_size": "the longest prefill chunk of one request per step",
    "policy": "lpm: longest cached prefix first; fcfs: arrival order",
    "max_waiting_requests": "a full waiting queue answers 503",
    "max_wait_steps": "LPM age bound, in scheduling steps",
    "speculate": "draft tokens from the radix tree, the request's own tokens and its grammar, "
    "verified in the decode step: tree (always), auto (where greedy output stays identical), "
    "off; docs/engine.md",
    "host": "the address to bind (0.0.0.0 exposes the server)",
    "port": "the TCP port",
    "model_name": "the model id served by /v1/models (default: from --model)",
    "worker_id": "this replica's name in each response's x-radixlm-worker (default: host:port)",
    "salt_from": "each request's prefix-cache namespace: api-key (one per key), header:NAME "
    "(from a header your proxy sets) or none (only the client's cache_salt); docs/security.md",
    "report_cached_tokens": "usage.cached_tokens: exact, page (rounded down to "
    "--cached-tokens-page) or none (left out)",
    "cached_tokens_page": "the rounding unit of --report-cached-tokens page",
    "max_body_bytes": "a larger request body is a 413, read no further",
    "body_timeout_s": "seconds a request body may take to arrive (then 408)",
    "body_idle_timeout_s": "seconds a request body may pause between pieces (then 408)",
    "header_timeout_s": "seconds a connection may take to send its request headers (then it "
    "is closed)",
    "max_concurrent_tokenizations": "prompts tokenized at once, in threads",
    "max_queued_tokenizations": "prompts waiting for a tokenizer thread; more is a 503",
    "metrics_snapshot_ttl_s": "/metrics reuses an engine snapshot this young",
    "cache_page_text": "the /cache page shows token text (prompts are private)",
    "max_stored_responses": "stored responses (the Responses API) per cache namespace",
    "max_stored_response_bytes": "bytes of stored responses, all namespaces together",
}

# ServerConfig fields with a flag of their own; api_keys comes from --api-key / --api-key-file.
_SERVER_FLAGS = (
    "host", "port", "model_name", "salt_from", "report_cached_tokens", "cached_tokens_page",
    "max_body_bytes", "body_timeout_s", "body_idle_timeout_s", "header_timeout_s",
    "max_concurrent_tokenizations",
    "max_queued_tokenizations", "metrics_snapshot_ttl_s", "worker_id", "cache_page_text",
    "max_stored_responses", "max_stored_response_bytes",
)  # fmt: skip


class EngineConfigs(NamedTuple):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config: type,
    title: str,
    only: tuple[str, ...] | None = None,
) -> None:
    """One flag per field of the dataclass `config` (or the fields in `only`)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if not f.init or (only is not None and f.name not in only):
            continue
        kind, choices = _flag_type(hints[f.name])
        default = _default(f)
        doc = _HELP.get(f.name, f.name.replace("_", " "))
        kwargs: dict[str, Any] = {"dest": f.name, "default": None}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=kind, choices=choices, metavar=None if choices else f.name.upper())
        if "(default:" not in doc:  # a help text may word its default itself
            doc = f"{doc} (default: {default})"
        group.add_argument("--" + _FLAGS.get(f.name, f.name).replace("_", "-"), help=doc, **kwargs)


def config_from_args(args: argparse.Namespace, config: type[C], **overrides: Any) -> C:
    """The dataclass from the flags that were given; raises ValueError on a bad value."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(config)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    return config(**{**values, **overrides})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ModelConfig, "model")
    add_config_arguments(parser, CacheConfig, "KV cache")
    add_config_arguments(parser, SchedulerConfig, "scheduler")


def engine_configs(args: argparse.Namespace) -> EngineConfigs:
    return EngineConfigs(
        config_from_args(args, ModelConfig),
        config_from_args(args, CacheConfig),
        config_from_args(args, SchedulerConfig),
    )


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServerConfig, "server", only=_SERVER_FLAGS)
    keys = parser.add_argument_group("API keys (none: the /v1 routes are open)")
    keys.add_argument(
        "--api-key", action="append", dest="api_key_values", metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes; repeat for several keys "
        "(each its own cache namespace with --salt-from api-key)",
    )  # fmt: skip
    keys.add_argument(
        "--api-key-file", metavar="PATH",
        help="API keys, one per line ('#' comments); keeps them out of the process list",
    )  # fmt: skip
    keys.add_argument(
        "--admin-key", metavar="KEY",
        help="the key of cache-wide routes (/v1/cache, /v1/cache/flush, /flush_cache, and "
        "/metrics once set) and of every tenant's observatory; never a tenant key",
    )  # fmt: skip
    keys.add_argument(
        "--admin-key-file", metavar="PATH",
        help="the admin key, read from the first line of this file",
    )  # fmt: skip


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the flags; raises ValueError on a bad value or an unreadable keys file."""
    keys = list(args.api_key_values or ())
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ValueError(f"cannot read --api-key-file: {exc}") from exc
        keys += [line for line in lines if line and not line.startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    admin = args.admin_key
    if args.admin_key_file:
        admin = _first_key(args.admin_key_file, "--admin-key-file")
    return config_from_args(
        args, ServerConfig, api_keys=tuple(dict.fromkeys(keys)), admin_key=admin
    )


def _first_key(path: str, flag: str) -> str:
    """The first line of `path` that is neither empty nor a '#' comment."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise ValueError(f"cannot read {flag}: {exc}") from exc
    key = next((line for line in lines if line and not line.startswith("#")), None)
    if key is None:
        raise ValueError(f"{flag} {path} holds no key")
    return key


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """Sampling flags for chat and generate (a few of SamplingParams' fields)."""
    fields = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
    add_config_arguments(parser, SamplingParams, "sampling", only=(*fields, "ignore_eos"))
    parser.set_defaults(max_tokens=max_tokens)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _flag_type(annotation: Any) -> tuple[type, list[Any] | None]:
    """(argparse type, choices) for a field annotation: int, float, str, bool, Literal, X | None."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        choices = list(get_args(annotation))
        return type(choices[0]), choices
    if annotation in (int, float, str, bool):
        return annotation, None
    raise TypeError(f"no command-line flag for a field of type {annotation!r}")
