"""The server work one request causes per step is bounded by a constant times its own tokens:
for random requests (up to 16 stop strings of any length the bound allows, up to 300
logit_bias entries, min_tokens bans, outputs of any ids: text that follows the stop strings,
special tokens, stray bytes), each token pushed costs the streaming detokenizer, the stop check
and the logit adjustment at most WORK_PER_TOKEN x (prompt + output tokens so far). Work is
counted (ids decoded, characters scanned and emitted, logit positions set), never timed.

The bound is not vacuous: the stop check it replaced (every held length compared with every
stop string's prefix on every token) breaks it on the same kind of stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_tokenizers import byte_level, token_id

from radixlm.api_types import SamplingParams
from radixlm.detokenizer import OutputStream
from radixlm.engine.sampler import SamplingState
from radixlm.server.protocol import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP

WORK_PER_TOKEN = 1024  # the constant: work units per token of the request, per step

TOK = byte_level()
A, B = TOK.encode("a", add_special_tokens=False)[0], TOK.encode("b", add_special_tokens=False)[0]
SPECIAL = token_id(TOK, "<|im_start|>")
STRAY = next(i for i in range(TOK.vocab_size) if TOK.decode([i]) == "\ufffd")  # a lone byte


class CountingTokenizer:
    """The byte-level tokenizer, counting the ids each decode reads."""

    def __init__(self) -> None:
        self.hf_tokenizer = TOK.hf_tokenizer
        self.eos_token_ids = TOK.eos_token_ids
        self.decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return TOK.decode(ids)


def step_work(params: SamplingParams, prompt: list[int], outputs: list[int]) -> list[int]:
    """The work of each step of one request whose sampled tokens are `outputs`."""
    tokenizer = CountingTokenizer()
    stream = OutputStream(tokenizer, params)  # type: ignore[arg-type]  # a stand-in tokenizer that counts its work
    state = SamplingState(params, prompt, [], stop_ids=frozenset({SPECIAL}))
    logits = torch.zeros(1, TOK.vocab_size)
    work: list[int] = []
    for token in outputs:
        before = tokenizer.decoded + stream.stop_work
        adjusted = _adjusted_positions(state, logits)
        stream.push(token)
        state.output_ids = stream.token_ids
        work.append(tokenizer.decoded + stream.stop_work - before + adjusted)
        if stream.finish_reason is not None:
            break
    return work


def _adjusted_positions(state: SamplingState, logits: torch.Tensor) -> int:
    """Logit positions the step's adjustment sets (its tensors, built once per request)."""
    from radixlm.engine.logit_adjust import apply_logit_bias

    apply_logit_bias(logits, [state])
    adjust = state.row_adjust(logits.shape[1])
    banning = len(state.output_ids) < state.params.min_tokens
    return len(adjust.bias_ids) + (len(adjust.banned_ids) if banning else 0)


def stop_strings() -> st.SearchStrategy[list[str]]:
    """Stop strings an attacker would pick: long runs the output can follow for a while."""
    piece = st.text(alphabet="ab", min_size=1, max_size=400)
    return st.lists(piece, max_size=MAX_STOP)


def outputs() -> st.SearchStrategy[list[int]]:
    return st.lists(
        st.sampled_from([A, A, A, B, SPECIAL, STRAY]) | st.integers(0, TOK.vocab_size - 1),
        min_size=1,
        max_size=300,
    )


@settings(max_examples=60, deadline=None)
@given(
    stop=stop_strings(),
    bias=st.dictionaries(
        st.integers(0, TOK.vocab_size + 50), st.floats(-100, 100), max_size=MAX_LOGIT_BIAS_ENTRIES
    ),
    min_tokens=st.integers(0, 50),
    prompt_len=st.integers(1, 40),
    ids=outputs(),
)
@example(stop=["a" * 399 + "b"] + ["ab" * 200] * 15, bias={}, min_tokens=0, prompt_len=1,
         ids=[A] * 300)  # fmt: skip
def test_work_per_step_is_bounded_by_the_request_s_own_tokens(
    stop: list[str], bias: dict[int, float], min_tokens: int, prompt_len: int, ids: list[int]
) -> None:
    params = SamplingParams(
        max_tokens=len(ids), stop=tuple(stop), logit_bias=tuple(bias.items()),
        min_tokens=min(min_tokens, len(ids)), ignore_eos=True,
    )  # fmt: skip
    prompt = [A] * prompt_len
    for step, work in enumerate(step_work(params, prompt, ids)):
        own_tokens = prompt_len + step + 1
        assert work <= WORK_PER_TOKEN * own_tokens, (step, work)


def test_the_bound_separates_a_quadratic_stop_check() -> None:
    """The former stop check, priced at one unit per character sliced or compared, on the
    example stream above (one stop string keeps the output held, the others match none of its
    long suffixes): past a hundred held characters one step costs more than the bound allows,
    where the KMP check stays far below it."""
    stops = ["a" * 399 + "b"] + ["ab" * 200] * (MAX_STOP - 1)
    text = ""
    broke_at = None
    for step in range(300):
        text += "a"
        if quadratic_stop_work(text, stops) > WORK_PER_TOKEN * (step + 2):
            broke_at = step
            break
    assert broke_at is not None and broke_at < 300
    params = SamplingParams(max_tokens=300, stop=tuple(stops), ignore_eos=True)
    ours = step_work(params, [A], [A] * 300)
    assert max(w / (step + 2) for step, w in enumerate(ours)) < WORK_PER_TOKEN / 4


def quadratic_stop_work(text: str, stops: Sequence[str]) -> int:
    """Work of the former partial-stop check on `text` (whose tail is all held): for each stop
    string, every length from the longest down to the first that matches, each a slice of that
    many characters and a comparison of as many."""
    work = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            work += 2 * n
            if text.endswith(s[:n]):
                break
    return work


def test_the_counting_tokenizer_counts() -> None:
    """The decode count is real: a push decodes at least the id it adds."""
    tokenizer = CountingTokenizer()
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=4))  # type: ignore[arg-type]  # a stand-in tokenizer that counts its work
    stream.push(A)
    assert tokenizer.decoded >= 1
