"""The tokenizer layer: encode/decode, end-of-sequence ids; chat templates and message validation
through the one renderer (`PromptRenderer`, `check_messages`)."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_tokenizers import byte_level, sentencepiece_like, smollm

from radixlm.agents.chat_format import check_messages
from radixlm.agents.prompt import NoChatTemplateError, PromptRenderer

MULTILINGUAL = "héllo 世界 🙂 the quick fox 🎉"


def test_encode_decode_round_trip() -> None:
    for tokenizer in (byte_level(), sentencepiece_like()):
        ids = tokenizer.encode(MULTILINGUAL)
        assert tokenizer.decode(ids) == MULTILINGUAL
        assert max(ids) < tokenizer.vocab_size


def test_decode_skips_special_tokens_and_keeps_spaces_verbatim() -> None:
    tokenizer = byte_level()
    eos = tokenizer.hf_tokenizer.eos_token_id
    assert tokenizer.decode([eos, *tokenizer.encode("a ."), eos]) == "a ."


def test_eos_ids_include_the_chat_templates_end_of_turn() -> None:
    hf = byte_level().hf_tokenizer
    assert byte_level().eos_token_ids == {
        hf.convert_tokens_to_ids("<|endoftext|>"),
        hf.convert_tokens_to_ids("<|im_end|>"),
    }
    hf = sentencepiece_like().hf_tokenizer  # no template: the eos alone
    assert sentencepiece_like().eos_token_ids == {hf.convert_tokens_to_ids("</s>")}


def test_chat_template_ends_with_the_assistant_header() -> None:
    tokenizer = byte_level()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "世界"}],
        },
    ]
    renderer = PromptRenderer(tokenizer)
    text = renderer.render(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo\n世界<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = renderer.prompt_ids(messages)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(header) :] == header
    assert tokenizer.hf_tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_start|>"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        (
            [{"role": "user", "content": "x"}, {"role": "user"}],
            r"messages\[1\]\.content is missing",
        ),
        ([{"role": "user", "content": None}], "content is missing"),
        ([{"role": "user", "content": 5}], "string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            r"content\[0\] must be a text part",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"text must be a string"),
    ],
)
def test_invalid_messages_are_rejected_with_a_clear_message(messages: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check_messages(messages)
    with pytest.raises(ValueError, match=error):
        PromptRenderer(byte_level()).prompt_ids(messages)  # type: ignore[arg-type]  # the bad value under test


def test_valid_messages_keep_their_other_fields() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call], "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    assert check_messages(messages) == [
        {"role": "assistant", "content": None, "name": "bot",
         "tool_calls": [{"id": "call_1", "name": "f", "arguments": "{}"}]},
        messages[1],
    ]  # fmt: skip


def test_a_tokenizer_without_a_chat_template_says_so() -> None:
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        PromptRenderer(sentencepiece_like()).prompt_ids([{"role": "user", "content": "hi"}])


def test_default_model_tokenizer_from_its_gguf() -> None:
    tokenizer = smollm()
    hf = tokenizer.hf_tokenizer
    assert tokenizer.vocab_size == 49152
    assert hf.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
    ids = PromptRenderer(tokenizer).prompt_ids([{"role": "user", "content": "What is 2 + 2?"}])
    header = [hf.convert_tokens_to_ids("<|im_start|>"), *tokenizer.encode("assistant\n")]
    assert ids[-len(header) :] == header
    assert tokenizer.decode(tokenizer.encode(MULTILINGUAL)) == MULTILINGUAL
