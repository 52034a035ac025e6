"""Streaming text: deltas never change later and add up to the full decode; stop strings are
found across tokens and never shown; an output ends for exactly the documented reasons."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_tokenizers import byte_level, sentencepiece_like, smollm, token_id

from radixlm.api_types import SamplingParams
from radixlm.detokenizer import IncrementalDetokenizer, OutputStream, StopChecker
from radixlm.tokenizer import Tokenizer

MULTILINGUAL = "héllo 世界 🙂 the quick fox 🎉 déjà vu, 你好!"


def stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Push `ids` in chunks of the given sizes (one by one by default); the deltas, flush last.

    Checks on the way that nothing emitted is ever revised: the text so far always begins the
    full decode (for sentencepiece byte runs, only when the output is valid UTF-8; see
    IncrementalDetokenizer).
    """
    detokenizer = IncrementalDetokenizer(tokenizer)
    full = tokenizer.decode(ids)
    exact = "\ufffd" not in full or tokenizer is not sentencepiece_like()
    deltas, start = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detokenizer.push(ids[start : start + size]))
        start += size
        assert full.startswith(detokenizer.text) or not exact
    deltas.append(detokenizer.push(ids[start:]))
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    assert detokenizer.text == full or not exact
    return deltas


@pytest.mark.parametrize("tokenizer", [byte_level, sentencepiece_like, smollm])
def test_multilingual_stream_equals_full_decode(tokenizer: Callable[[], Tokenizer]) -> None:
    tok = tokenizer()
    ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    deltas = stream(tok, ids)
    assert "".join(deltas) == MULTILINGUAL
    assert not any("\ufffd" in d for d in deltas)  # split characters were held, not mangled
    assert len(ids) > len([d for d in deltas if d])  # some tokens really were partial characters


def test_byte_fallback_run_that_turns_invalid_keeps_streamed_characters() -> None:
    tok = sentencepiece_like()
    a, invalid = token_id(tok, "<0x41>"), token_id(tok, "<0xE4>")
    assert tok.decode([a, invalid]) == "\ufffd\ufffd"  # the decoder's view of the whole run
    detokenizer = IncrementalDetokenizer(tok)
    assert detokenizer.push([a]) == "A"
    assert detokenizer.push([invalid]) == ""
    assert detokenizer.flush() == "\ufffd"


def test_sentencepiece_leading_space_survives_special_tokens() -> None:
    tok = sentencepiece_like()
    eos = tok.hf_tokenizer.eos_token_id
    the, fox = (
        tok.encode("the", add_special_tokens=False),
        tok.encode("fox", add_special_tokens=False),
    )
    ids = [*the, eos, eos, *tok.encode(" fox", add_special_tokens=False)]
    assert tok.decode(ids) == "the fox"
    assert stream(tok, ids)[0] == "the"  # the first word has no space of its own
    assert "".join(stream(tok, ids)) == "the fox"
    assert "".join(stream(tok, [eos, *fox])) == "fox"


def token_ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_id_sequence_streams_to_its_decode(data: st.DataObject) -> None:
    tok = data.draw(st.sampled_from([byte_level(), sentencepiece_like()]))
    ids = data.draw(token_ids(tok))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    stream(tok, ids, chunks)  # checks the stream against the full decode


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=30))
def test_default_model_streams_any_text(text: str) -> None:
    tok = smollm()
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_stop_string_spanning_pieces_is_found_and_withheld() -> None:
    checker = StopChecker(["</end>"])
    assert checker.push("hello </") == ("hello ", None)  # "</" could begin the stop string
    assert checker.push("e") == ("", None)
    assert checker.push("nd> after") == ("", "</end>")
    with pytest.raises(RuntimeError, match="already stopped"):
        checker.push("more")


def test_withheld_text_is_released_when_it_cannot_be_a_stop() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("a ST") == ("a ", None)
    assert checker.push("ONE") == ("STONE", None)
    assert checker.push("ST") == ("", None)
    assert checker.flush() == "ST"


def test_the_earliest_stop_string_wins() -> None:
    assert StopChecker(["b", "ab"]).push("xab") == ("x", "ab")
    assert StopChecker(["cd", "abc"]).push("zzabcd") == ("zz", "abc")


def reference_stop(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Brute force: after each piece, look for stop strings in all the text so far."""
    text = ""
    for piece in pieces:
        text += piece
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            start, stop = min(found)
            return text[:start], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab c", max_size=5), max_size=10),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
)
def test_stop_checker_matches_brute_force(pieces: list[str], stops: list[str]) -> None:
    checker = StopChecker(stops)
    expected_text, expected_stop = reference_stop(pieces, stops)
    emitted = ""
    for piece in pieces:
        match = checker.push(piece)
        emitted += match.text
        assert expected_text.startswith(emitted)  # never shows what a stop string will hide
        if match.stop is not None:
            assert match.stop in stops
            break
    else:
        emitted += checker.flush()
    assert emitted == expected_text
    if expected_stop is not None:  # ties in start position may name either string
        assert checker.stopped is not None and expected_text + checker.stopped in "".join(pieces)


def run(params: SamplingParams, ids: list[int]) -> OutputStream:
    tok = byte_level()
    output = OutputStream(tok, params)
    for next_id in ids:
        delta = output.push(next_id)
        if delta.finish_reason is not None:
            break
    return output


def test_output_ends_on_max_tokens_with_every_character_emitted() -> None:
    tok = byte_level()
    ids = tok.encode("fox 🙂", add_special_tokens=False)
    output = run(SamplingParams(max_tokens=len(ids)), ids + ids)
    assert (output.finish_reason, output.token_ids, output.text) == ("length", ids, "fox 🙂")
    cut = run(SamplingParams(max_tokens=len(ids) - 1), ids)  # stops mid-emoji: shown as U+FFFD
    assert cut.finish_reason == "length" and cut.text == tok.decode(ids[:-1])
    with pytest.raises(RuntimeError, match="already finished"):
        cut.push(ids[0])


def test_output_ends_on_eos_unless_ignored_and_on_stop_token_ids() -> None:
    tok = byte_level()
    ids = tok.encode("hello world", add_special_tokens=False)
    im_end = token_id(tok, "<|im_end|>")
    output = run(SamplingParams(max_tokens=50), [*ids, im_end, *ids])
    assert output.finish_reason == "stop"
    assert output.token_ids == [*ids, im_end]  # the stop token is kept, its text is not
    assert output.text == "hello world"
    ignoring = run(
        SamplingParams(max_tokens=2 * len(ids) + 1, ignore_eos=True), [*ids, im_end, *ids]
    )
    assert (ignoring.finish_reason, ignoring.text) == ("length", "hello worldhello world")
    stop_id = ids[1]
    by_id = run(SamplingParams(max_tokens=50, stop_token_ids=(stop_id,)), ids)
    assert (by_id.finish_reason, by_id.token_ids) == ("stop", ids[:2])
    assert by_id.text == tok.decode(ids[:1])


def test_output_ends_before_a_stop_string_that_spans_tokens() -> None:
    tok = byte_level()
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    output = run(SamplingParams(max_tokens=50, stop=("ck br",)), ids)
    assert (output.finish_reason, output.text) == ("stop", "the qui")
    assert tok.decode(output.token_ids).startswith("the quick br")
