"""Text and token ids for one model: encoding, decoding, special tokens and end-of-sequence ids.

`Tokenizer` wraps a Hugging Face tokenizer (the model loader builds it from a HF directory or a
GGUF file). Streaming text out of sampled ids lives in `radixlm.detokenizer`; chat messages to
prompt ids in `radixlm.agents.prompt` (the one renderer, with the special-token forgery guard).

`max_chars_per_token` bounds how much text one token can stand for, so the server can refuse a
prompt that cannot fit the context before paying for its tokenization.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Assistant content the end-of-turn probe renders; the template's text right after it ends a turn.
_PROBE = "radixlm-end-of-turn-probe"


class Tokenizer:
    """One model's tokenizer. Immutable after construction; safe to share between threads.

    `eos_token_ids` holds every id that ends a generation: the tokenizer's eos, the chat
    template's end-of-turn token when it has one (e.g. <|im_end|>, <|eot_id|>), and
    `extra_eos_token_ids` (e.g. from a model's generation config). It may be empty.
    """

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        end_of_turn = _end_of_turn_token_id(hf_tokenizer)
        if end_of_turn is not None:
            eos.add(end_of_turn)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.max_chars_per_token = _max_chars_per_token(hf_tokenizer)
        # every special token: a chat template's control tokens, never message content
        self.special_ids: frozenset[int] = frozenset(_special_tokens(hf_tokenizer))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory or a .gguf file, never from the network."""
        path = Path(path)
        if path.suffix == ".gguf":
            hf = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        else:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's logits may be
        wider, padded to a round size)."""
        return len(self.hf_tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return self.hf_tokenizer.chat_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, as a fresh prompt (e.g. a BOS first)."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens skipped, verbatim: the legacy space cleanup
        (" ." -> ".") is off, so streamed deltas and a full decode always agree."""
        return str(
            self.hf_tokenizer.decode(
                list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )


def _end_of_turn_token_id(hf: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, if any.

    Rendering a probe conversation finds it for any template (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>) without a table of model families.
    """
    if hf.chat_template is None:
        return None
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = str(hf.apply_chat_template(probe, tokenize=False))
    except Exception:  # a template may reject the probe (e.g. it demands a system message)
        return None
    if _PROBE not in text:
        return None
    after = text[text.index(_PROBE) + len(_PROBE) :].lstrip()
    special = {str(t.content): i for i, t in hf.added_tokens_decoder.items()}
    special.update(zip(hf.all_special_tokens, hf.all_special_ids))
    # The longest match, so "<|im_end|>" wins over a shorter token that is its prefix.
    for content in sorted(special, key=len, reverse=True):
        if content and after.startswith(content):
            return int(special[content])
    return None


def _max_chars_per_token(hf: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters of text one token can cover.

    A vocabulary entry's string is at least as long as the text it matches: byte-level entries
    spell one character per byte, metaspace entries one per character, byte fallback `<0xNN>`
    six for one. A Unicode normalizer may fold a few characters into one (composition), hence
    the factor when the tokenizer has one.
    """
    longest = max((len(token) for token in hf.get_vocab()), default=1)
    backend = getattr(hf, "backend_tokenizer", None)
    folds = backend is not None and backend.normalizer is not None
    return max(longest, 1) * (4 if folds else 1)


def _special_tokens(hf: PreTrainedTokenizerBase) -> dict[int, str]:
    """id -> text of every special token (the ones a chat template uses as control)."""
    control = {int(i): str(t.content) for i, t in hf.added_tokens_decoder.items() if t.special}
    control.update({int(i): str(t) for t, i in zip(hf.all_special_tokens, hf.all_special_ids)})
    return {i: t for i, t in control.items() if t}
