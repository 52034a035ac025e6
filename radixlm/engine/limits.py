"""The checks a request passes before it is queued: a request that could never run is refused
with a ValueError naming why (a 400 for the server), never admitted to fail later."""

from __future__ import annotations

from radixlm.api_types import SamplingParams


def check_request(
    prompt: list[int], params: SamplingParams, vocab: int, context: int, capacity: int
) -> None:
    """Raise ValueError unless `prompt` (token ids) with `params` fits a model of `vocab` ids
    and `context` positions and a pool of `capacity` slots: alone, it always runs to the end."""
    if not prompt:
        raise ValueError("the prompt is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})")
    need = len(prompt) + params.max_tokens
    if need > context:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length of {context} tokens"
        )
    if need > capacity:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) needs "
            f"more KV slots than the pool holds ({capacity})"
        )
