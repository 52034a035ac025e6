"""The model runner: owns the model and the KV pool, and turns a ForwardBatch into logits.

Nothing else touches the model's weights or the pool's tensors; the prefix cache hands out the
pool's slot ids, the runner's model reads and writes the K/V rows behind them.
"""

from __future__ import annotations

import logging
import os

import torch

from radixlm.cache.kv_pool import KVPool
from radixlm.config import CacheConfig, DType, ModelConfig
from radixlm.model.backend import default_dtype
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import LoadProgress, load_model
from radixlm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int8": torch.int8,  # codes and scales (cache/kv_quant.py); the pool only
}  # fmt: skip


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        progress: LoadProgress | None = None,
    ) -> None:
        torch.set_num_threads(model_config.num_threads or _available_cores())
        if model_config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {model_config.device!r} asked for, but CUDA is not available")
        # "auto" becomes what this CPU runs fastest (backend.default_dtype)
        dtype: DType = (
            default_dtype(model_config.device)
            if model_config.dtype == "auto"
            else model_config.dtype
        )
        self.dtype = dtype
        if model_config.dtype == "auto":
            log.info("dtype auto: %s on this CPU", dtype)
        loaded = load_model(
            model_config.path, dtype, model_config.device, progress=progress,
            quant=model_config.quant, quantize=model_config.quantize,
        )  # fmt: skip
        self.model = loaded.model
        self.arch = loaded.config
        self.tokenizer = Tokenizer(loaded.tokenizer, extra_eos_token_ids=self.arch.eos_token_ids)
        self.device = torch.device(model_config.device)
        kv_dtype = _DTYPES[cache_config.kv_dtype or dtype]
        if progress is not None:
            progress("KV pool", 0, 1)
        self.pool = KVPool(
            cache_config.num_slots,
            self.arch.num_layers,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            dtype=kv_dtype,
            device=self.device,
        )
        if progress is not None:
            progress("KV pool", 1, 1)
        # the native kernels' variant, chosen and loaded with the model (before the first
        # request, which never waits for them); None: the PyTorch paths run
        kernels = self.model.backend.for_pool(self.pool).kernels
        self.kernels_isa: str | None = None if kernels is None else kernels.isa
        if progress is not None and self.device.type == "cpu":
            progress("native kernels", 1, 1)

    @property
    def max_context_len(self) -> int:
        return int(self.arch.max_context_len)

    @property
    def vocab_size(self) -> int:
        return int(self.arch.vocab_size)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one forward pass: (R, vocab) float32 logits for the batch's logits rows."""
        with torch.inference_mode():
            return self.model(batch, self.pool).float()


def _available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
