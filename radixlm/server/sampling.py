"""The engine's SamplingParams from a request's fields, with the checks that need the model's
limits: the token budget (max_tokens defaults to what the context and the pool leave), logit_bias
ids inside the vocabulary, and a grammar whose first token min_tokens would ban. One place for
/v1/completions, /v1/chat/completions and /v1/responses, so each refuses the same things the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from radixlm.agents.grammar import Constraint
from radixlm.api_types import SamplingParams
from radixlm.server.bounds import check_fits
from radixlm.server.errors import APIError
from radixlm.server.state import ServerState


@dataclass(frozen=True)
class SamplingFields:
    """What a request asks of sampling, in the engine's terms (None: the default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    cache_retention: Literal["in_memory", "24h"] | None = None


def sampling_params(
    state: ServerState,
    fields: SamplingFields,
    prompt_len: int,
    prompt_param: str,
    constraint: Constraint | None = None,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """The engine's params for a prompt of `prompt_len` tokens (the longest of a batch); a 400
    naming the field for what cannot run."""
    vocab = state.limits.vocab_size
    bad = next((t for t, _ in fields.logit_bias if t >= vocab), None)
    if bad is not None:
        message = f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})"
        raise APIError(400, message, param="logit_bias")
    limit = state.limits.max_seq_len
    check_fits(state.limits, prompt_len, prompt_param)
    max_tokens = fields.max_tokens
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"You requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion), but {state.limits.describe()}; "
            f"reduce the prompt or {max_tokens_param}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    if constraint is not None and fields.min_tokens > 0:
        eos = frozenset() if fields.ignore_eos else state.engine.tokenizer.eos_token_ids
        try:
            constraint.check_first_token(eos | frozenset(fields.stop_token_ids))
        except ValueError as exc:
            raise APIError(400, str(exc), param="min_tokens") from exc
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if fields.temperature is None else fields.temperature,
            top_p=1.0 if fields.top_p is None else fields.top_p,
            top_k=fields.top_k if fields.top_k is not None and fields.top_k > 0 else None,
            min_p=fields.min_p or 0.0,
            repetition_penalty=fields.repetition_penalty or 1.0,
            presence_penalty=fields.presence_penalty or 0.0,
            frequency_penalty=fields.frequency_penalty or 0.0,
            seed=fields.seed,
            stop=fields.stop,
            stop_token_ids=fields.stop_token_ids,
            ignore_eos=fields.ignore_eos,
            logprobs=fields.logprobs,
            n=fields.n,
            logit_bias=fields.logit_bias,
            min_tokens=fields.min_tokens,
            constraint=constraint,
            cache_retention=fields.cache_retention,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
