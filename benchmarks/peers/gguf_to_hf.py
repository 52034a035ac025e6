"""Dequantize the SmolLM2 GGUF into a float32 Hugging Face directory (for vLLM), once.

    python benchmarks/peers/gguf_to_hf.py GGUF OUT_DIR

transformers reads the GGUF (tokenizer and chat template included) and dequantizes it; the
result is the same weights every other engine serves, as plain safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(gguf: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers tags a GGUF-loaded model as quantized (quant_method=gguf) although its weights
    # are dequantized fp32 tensors by now, and save_pretrained would refuse to serialize it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
