"""Text and token ids for one model: encoding, decoding, the chat template and end-of-sequence ids.

`Tokenizer` wraps a Hugging Face tokenizer (the model loader builds it from a HF directory or a
GGUF file) and is the only module that calls it; streaming text out of sampled ids lives in
`radixlm.detokenizer`. Chat messages are validated here, once, so the server and the offline API
reject the same bad input with the same message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")

# Assistant content the end-of-turn probe renders; the template's text right after it ends a turn.
_PROBE = "radixlm-end-of-turn-probe"


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, so chat messages cannot be turned into a prompt."""


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

    def render_chat(self, messages: object) -> str:
        """The chat template applied to `messages`, ending with the assistant's header.

        Raises ValueError for invalid messages (see `validate_messages`) and NoChatTemplateError
        when the tokenizer has no template.
        """
        conversation = validate_messages(messages)
        if not self.has_chat_template:
            raise NoChatTemplateError(
                "this model's tokenizer has no chat template; send a plain prompt (completions) "
                "or give the model a chat template"
            )
        text = self.hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def apply_chat_template(self, messages: object) -> list[int]:
        """Prompt token ids for `messages` (see `render_chat`). The template writes any BOS
        itself, so the tokenizer adds no special tokens of its own."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check chat messages and return them with every content flattened to one string.

    A message is a mapping with "role" (one of ROLES) and "content": a string or a list of
    {"type": "text", "text": str} parts, joined with newlines. Other keys (name, tool_call_id)
    pass through. Raises ValueError naming the first offending message and field.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_validate_message(i, message) for i, message in enumerate(messages)]


def _validate_message(i: int, message: object) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    if "content" not in message or message["content"] is None:
        raise ValueError(f"{where}.content is missing")
    return {**message, "content": _flatten_content(where, message["content"])}


def _flatten_content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', ...}}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


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
