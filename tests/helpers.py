"""Helpers shared by the tests (imported as `helpers`; conftest.py holds only fixtures).

- `save_tiny_model(variant, path)` builds a tiny random Hugging Face model of one supported flag
  combination (TINY_VARIANTS) and saves it with `save_pretrained` (safetensors and a byte-level
  tokenizer) into `path`; it returns the transformers model, the numerical reference.
- `tree_machine(...)`: the hypothesis state machine of random tree operations against the
  brute-force reference (tests/tree_reference.py) that the tree and eviction-policy property
  tests extend.
- `load_script(path)`: a script of benchmarks/ (outside the package) as a module.
Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tree_reference import Key, ReferenceCache

from radixlm.cache.radix_tree import RadixTree, TreeNode

TINY_VOCAB = 260  # 256 byte tokens + 2 specials + 2 unused rows
TINY_BASE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 256,
    "eos_token_id": 257,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so all three llama3 branches are taken
}
# variant name -> (transformers config class name, config overrides)
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-llama3rope": (
        "LlamaConfig", {"num_key_value_heads": 2, "rope_scaling": LLAMA3_ROPE}
    ),
    "llama-mha-tied-bias": (
        "LlamaConfig",
        {"num_key_value_heads": 4, "tie_word_embeddings": True, "attention_bias": True,
         "mlp_bias": True},
    ),
    "llama-mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "mistral-gqa-linrope": (
        "MistralConfig",
        {"num_key_value_heads": 2, "sliding_window": None,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
    ),
    "qwen2-gqa-tied": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3-gqa-qknorm": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),
}  # fmt: skip


@dataclass(frozen=True)
class TinyModel:
    variant: str
    path: Path  # the save_pretrained directory
    reference: Any  # the transformers model, float32, eval (its config's fields are dynamic)


TinyModels = Callable[[str], TinyModel]  # the tiny_hf_model fixture: a variant's model, built once


def save_tiny_model(variant: str, path: Path, seed: int = 0, **config_overrides: Any) -> Any:
    """Build a random model of `variant`, save it with its tokenizer at `path`, return it."""
    import transformers

    class_name, overrides = TINY_VARIANTS[variant]
    config = getattr(transformers, class_name)(**{**TINY_BASE, **overrides, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.eval()
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return model


def byte_level_tokenizer() -> Any:
    """A 258-token byte-level tokenizer (no merges) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({"<|im_start|>": 256, "<|im_end|>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    wrapped.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return wrapped


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """O(1) logits: the default 0.02-std init makes every difference look tiny."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


# -- the radix tree against the brute-force reference: the rules every tree property test shares --


TreeEntry = tuple[str | None, tuple[int, ...], TreeNode]  # (namespace, sequence, its end node)


class EvictionSnapshot(NamedTuple):
    """The reference just before an evict call, for subclasses' ordering checks."""

    protected: set[Key]
    leaves: set[Key]
    access: dict[Key, int]


def tree_machine(
    page_size: int, tokens: st.SearchStrategy[list[int]], policy: str = "lru"
) -> type[RuleBasedStateMachine]:
    """A state machine of random match / insert / lock / unlock / evict on a RadixTree beside a
    ReferenceCache, two namespaces. Every step checks its result against the reference, and the
    invariant checks integrity and the locked/evictable token counts after each step.
    Subclasses add rules and invariants, and may override `evicted` to check which nodes an
    evict call took."""
    namespaces = st.sampled_from([None, "tenant"])

    class TreeMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.page_size = page_size
            self.tree = RadixTree(page_size=page_size, policy=policy)
            self.ref = ReferenceCache(page_size)
            self.next_slot = 0
            self.unlocked: list[TreeEntry] = []  # nodes that may be locked (cleared by evict)
            self.locks: list[TreeEntry] = []  # every lock held, with repeats

        @rule(tokens=tokens, namespace=namespaces)
        def match(self, tokens: list[int], namespace: str | None) -> None:
            m = self.tree.match(np.array(tokens, dtype=np.int64), namespace)
            length, slots = self.ref.match(tokens, namespace)
            assert (m.length, m.slots.tolist()) == (length, slots)
            assert m.node.depth == length
            self.unlocked.append((namespace, tuple(tokens[:length]), m.node))

        @rule(tokens=tokens, namespace=namespaces)
        def insert(self, tokens: list[int], namespace: str | None) -> None:
            slots = list(range(self.next_slot, self.next_slot + len(tokens)))
            self.next_slot += len(tokens)
            r = self.tree.insert(
                np.array(tokens, dtype=np.int64), np.array(slots, dtype=np.int64), namespace
            )
            assert r.prefix_len == self.ref.insert(tokens, slots, namespace)
            end = len(tokens) // page_size * page_size
            assert r.node.depth == end
            self.unlocked.append((namespace, tuple(tokens[:end]), r.node))

        @precondition(lambda self: self.unlocked)
        @rule(pick=st.integers(0, 1 << 16))
        def lock(self, pick: int) -> None:
            namespace, seq, node = self.unlocked[pick % len(self.unlocked)]
            self.tree.lock(node)
            if seq:
                self.ref.locked.append((namespace, seq))
            self.locks.append((namespace, seq, node))

        @precondition(lambda self: self.locks)
        @rule(pick=st.integers(0, 1 << 16))
        def unlock(self, pick: int) -> None:
            namespace, seq, node = self.locks.pop(pick % len(self.locks))
            self.tree.unlock(node)
            if seq:
                self.ref.locked.remove((namespace, seq))

        @rule(num_tokens=st.integers(0, 3 * page_size))
        def evict(self, num_tokens: int) -> None:
            protected = self.ref.protected()
            before = EvictionSnapshot(protected, self.ref.leaves(), dict(self.ref.access))
            evictable_before = self.ref.num_tokens - len(protected) * page_size
            result = self.tree.evict(num_tokens)
            assert result.num_tokens == len(result.slots) >= min(num_tokens, evictable_before)
            gone = self.ref.remove_slots(set(result.slots.tolist()))
            assert len(gone) * page_size == result.num_tokens  # every freed slot was cached
            assert not protected.intersection(gone)
            self.evicted(gone, before)
            self.unlocked.clear()  # unlocked nodes may be gone now

        def evicted(self, gone: list[Key], before: EvictionSnapshot) -> None:
            """Hook: `gone` (reference keys) was just evicted; the base checks nothing more."""

        @invariant()
        def agrees_with_reference(self) -> None:
            self.tree.check_integrity()
            protected = len(self.ref.protected()) * page_size
            assert self.tree.protected_tokens == protected
            assert self.tree.evictable_tokens == self.ref.num_tokens - protected

    return TreeMachine


def load_script(path: Path, name: str) -> ModuleType:
    """A benchmark script as the module `name` (its folder goes on sys.path: the scripts import
    their siblings, as benchmarks/peers' `engines` and `report`)."""
    sys.path[:0] = [str(path.parent)]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sse_lines(body: str) -> list[str]:
    """A server-sent-events body's lines: SSE ends a line at CR, LF or CRLF only, never at the
    other breaks str.splitlines knows (U+2028 or U+0085 in generated text are JSON content)."""
    return re.split(r"\r\n|[\r\n]", body)


def sse_events(body: str) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-events body, in order (the final [DONE] left out)."""
    return [
        json.loads(line[len("data: ") :]) for line in sse_lines(body) if line.startswith("data: {")
    ]
