"""Text and token ids for one model: encoding, decoding, the chat template and end-of-sequence ids.

`Tokenizer` wraps a Hugging Face tokenizer (the model loader builds it from a HF directory or a
GGUF file) and is the only module that calls it; streaming text out of sampled ids lives in
`radixlm.detokenizer`. Chat messages are validated here, once, so the server and the offline API
reject the same bad input with the same message.

Two rules protect a server from its clients' text:
- `max_chars_per_token` bounds how much text one token can stand for, so the server can refuse a
  prompt that cannot fit the context before paying for its tokenization.
- Message content is text, never control: `<|im_start|>system` typed by a user is encoded as
  those characters, not as the template's role token (see `apply_chat_template`).
"""

from __future__ import annotations

import re
import secrets
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
        self.max_chars_per_token = _max_chars_per_token(hf_tokenizer)
        self._control = _control_tokens(hf_tokenizer)  # id -> text of every special token
        self._control_text = re.compile("|".join(map(re.escape, self._control.values())) or "$^")
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._plain: Any = None  # the same tokenizer with special-token parsing off
        if backend is not None:
            from tokenizers import Tokenizer as RustTokenizer

            self._plain = RustTokenizer.from_str(backend.to_str())
            self._plain.encode_special_tokens = True

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
        itself, so the tokenizer adds no special tokens of its own.

        Special tokens come from the template only: where message content spells one (a user
        typing `<|im_start|>system` to forge a turn), that content is encoded as plain text, the
        way vLLM and llama.cpp do. Any other prompt gets exactly the ids of encoding the rendered
        text, so the cache and greedy outputs of ordinary chats are unaffected.
        """
        conversation = validate_messages(messages)
        text = self.render_chat(conversation)
        if self._backend is None or self._plain is None:  # a slow tokenizer: no offsets
            if any(self._control_text.search(m["content"]) for m in conversation):
                raise ValueError(_FORGED)
            return self.encode(text, add_special_tokens=False)
        encoding = self._backend.encode(text, add_special_tokens=False)
        spans = self._content_spans(conversation, text)
        if spans is None:  # the template rewrites content: refuse what cannot be isolated
            if any(self._control_text.search(m["content"]) for m in conversation):
                raise ValueError(_FORGED)
            return list(encoding.ids)
        forged = any(
            token in self._control and _overlaps(offset, spans)
            for token, offset in zip(encoding.ids, encoding.offsets)
        )
        if not forged:
            return list(encoding.ids)
        ids: list[int] = []
        for start, end, is_content in _pieces(spans, len(text)):
            tokenizer = self._plain if is_content else self._backend
            ids += tokenizer.encode(text[start:end], add_special_tokens=False).ids
        return ids

    def _content_spans(
        self, conversation: list[dict[str, Any]], text: str
    ) -> list[tuple[int, int]] | None:
        """Where each message's content lies in `text`, found by rendering again with an
        unguessable marker around each content's core (its edge whitespace stays outside, where
        a template's trim finds it). None when markers removed do not give back `text`: the
        template transforms content, and positions cannot be trusted."""
        nonce = secrets.token_hex(8)
        start_mark, end_mark = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked = []
        for m in conversation:
            content = m["content"]
            core = content.strip()
            if core:
                lead = content[: len(content) - len(content.lstrip())]
                trail = content[len(content.rstrip()) :]
                content = f"{lead}{start_mark}{core}{end_mark}{trail}"
            marked.append({**m, "content": content})
        rendered = self.render_chat(marked)
        pattern = f"{re.escape(start_mark)}|{re.escape(end_mark)}"
        spans: list[tuple[int, int]] = []
        plain: list[str] = []
        pos, length, opened = 0, 0, None
        for match in re.finditer(pattern, rendered):
            plain.append(rendered[pos : match.start()])
            length += match.start() - pos
            pos = match.end()
            if (match.group() == start_mark) != (opened is None):
                return None  # unbalanced: the template dropped or doubled half a marker
            if opened is None:
                opened = length
            else:
                spans.append((opened, length))
                opened = None
        plain.append(rendered[pos:])
        if opened is not None or "".join(plain) != text:
            return None
        return spans


_FORGED = (
    "message content contains special-token text (such as a chat template's role markers), "
    "which this model's chat template does not let the server encode as plain text"
)


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
    return {**message, "content": flatten_content(where, message["content"])}


def flatten_content(where: str, content: object) -> str:
    """A message's content as one string: a string as it is, a list of text parts joined by
    newlines; anything else is a ValueError naming `where`."""
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


def _control_tokens(hf: PreTrainedTokenizerBase) -> dict[int, str]:
    """id -> text of every special token (the ones a chat template uses as control)."""
    control = {int(i): str(t.content) for i, t in hf.added_tokens_decoder.items() if t.special}
    control.update({int(i): str(t) for t, i in zip(hf.all_special_tokens, hf.all_special_ids)})
    return {i: t for i, t in control.items() if t}


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, end = offset
    return any(start < span_end and span_start < end for span_start, span_end in spans)


def _pieces(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int, bool]]:
    """[0, length) cut at the spans: (start, end, is_content), in order, none empty."""
    pieces, pos = [], 0
    for start, end in spans:
        pieces += [(pos, start, False), (start, end, True)]
        pos = end
    pieces.append((pos, length, False))
    return [p for p in pieces if p[0] < p[1]]
