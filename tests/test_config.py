"""Configuration and sampling parameters reject bad values with an error that names the field."""

from __future__ import annotations

import pytest

from radixlm.api_types import SamplingParams
from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_sequences() -> None:
    # a str and a list where the fields hold tuples: the conversion under test
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.stop == ("END",)
    assert p.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (CacheConfig, {"num_slots": 0}, "num_slots"),
        (CacheConfig, {"page_size": 0}, "page_size"),
        (CacheConfig, {"cache": "lru"}, "cache"),
        (CacheConfig, {"kv_dtype": "int4"}, "kv_dtype"),
        (SchedulerConfig, {"chunk_size": 0}, "chunk_size"),
        (SchedulerConfig, {"policy": "random"}, "policy"),
        (ModelConfig, {"dtype": "int8"}, "dtype"),
        (ModelConfig, {"device": "tpu"}, "device"),
    ],
)
def test_configs_reject_bad_values(cls: type, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)
