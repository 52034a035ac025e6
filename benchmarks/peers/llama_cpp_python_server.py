"""llama-cpp-python's OpenAI server, taught the three request features the shared client uses.

    LLAMA_VENV/bin/python benchmarks/peers/llama_cpp_python_server.py --model GGUF [server flags]

Its engine and cache are untouched; only the HTTP layer is widened, so that the same workloads
run against it as against every other engine:
- token-id prompts: the request model rejects a list of ints (its route would also cut a list
  prompt down to its first element); here it is taken as a tuple and handed on as a list, which
  `Llama.create_completion` accepts natively;
- `ignore_eos`: end-of-generation tokens are masked, so every request generates max_tokens;
- `token_ids` in each streamed choice (vLLM's `return_token_ids`): the ids generated since the
  previous chunk, so a follow-up request can extend its parent's actual output.
Everything else (flags, routes, the one-sequence-at-a-time lock) is `python -m llama_cpp.server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import llama_cpp
import llama_cpp.server.types as types
import numpy as np


class TokenIdCompletionRequest(types.CreateCompletionRequest):
    prompt: str | list[str] | tuple[int, ...] = ""
    ignore_eos: bool = False


# The app module binds the request model when it is imported: swap it in before.
types.CreateCompletionRequest = TokenIdCompletionRequest  # type: ignore[misc]

_original_call = llama_cpp.Llama.__call__
_original_generate = llama_cpp.Llama.generate


def _call(self: llama_cpp.Llama, prompt: Any, **kwargs: Any) -> Any:
    if isinstance(prompt, tuple):
        prompt = list(prompt)
    if kwargs.pop("ignore_eos", False):
        kwargs["logits_processor"] = llama_cpp.LogitsProcessorList(
            [*(kwargs.get("logits_processor") or []), _mask_eog(self)]
        )
    self._generated_ids = []  # type: ignore[attr-defined]  # filled by _generate
    result = _original_call(self, prompt, **kwargs)
    return _with_token_ids(self, result) if kwargs.get("stream") else result


def _generate(self: llama_cpp.Llama, *args: Any, **kwargs: Any) -> Iterator[int]:
    vocab = self._model.vocab
    for token in _original_generate(self, *args, **kwargs):
        if not llama_cpp.llama_vocab_is_eog(vocab, token):  # an EOG ends it, is not output
            self._generated_ids.append(token)  # type: ignore[attr-defined]
        yield token


def _with_token_ids(llama: llama_cpp.Llama, chunks: Iterator[dict[str, Any]]) -> Iterator[Any]:
    """Each chunk carries the ids generated since the previous one (text may lag behind ids
    while a multi-byte character or a stop string is pending; the ids never do)."""
    sent = 0
    for chunk in chunks:
        ids: list[int] = llama._generated_ids  # type: ignore[attr-defined]
        chunk["choices"][0]["token_ids"] = ids[sent:]
        sent = len(ids)
        yield chunk


def _mask_eog(llama: llama_cpp.Llama) -> Any:
    eog = getattr(llama, "_eog_ids", None)
    if eog is None:
        vocab = llama._model.vocab
        eog = np.array(
            [i for i in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        )
        llama._eog_ids = eog  # type: ignore[attr-defined]

    def mask(input_ids: Any, scores: Any) -> Any:
        scores[eog] = -np.inf
        return scores

    return mask


llama_cpp.Llama.__call__ = _call  # type: ignore[method-assign]
llama_cpp.Llama.generate = _generate  # type: ignore[method-assign]

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    main()
