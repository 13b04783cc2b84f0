"""Sampling parameters, requests and results: validation of what every backend receives."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engines.backend import GenerationRequest, GenerationResult, SamplingParams


def test_sampling_params_round_trip_and_replace() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, seed=3, stop=("##",))
    assert SamplingParams.from_dict(params.to_dict()) == params
    changed = params.replace(max_tokens=5, seed=None)
    assert (changed.max_tokens, changed.seed, changed.temperature) == (5, None, 0.7)
    assert SamplingParams(temperature=0).greedy and not params.greedy


@pytest.mark.parametrize(("changes", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": ("",)}, "stop"),
])
def test_sampling_params_reject_bad_values(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**changes)


def test_sampling_params_reject_wrong_types_and_unknown_keys() -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature="hot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.from_dict({"top_k": 5})


def test_request_needs_exactly_one_prompt_form() -> None:
    params = SamplingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest(sampling=params)
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest(sampling=params, prompt_ids=(1,), messages=({"role": "user"},))
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        GenerationRequest(sampling=params, prompt_ids=())
    with pytest.raises(ValueError, match="non-negative"):
        GenerationRequest(sampling=params, prompt_ids=(3, -1))
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        GenerationRequest(sampling=params, messages=({"role": "user"}, {"content": "x"}))
    with pytest.raises(TypeError, match="sampling"):
        GenerationRequest(sampling={"temperature": 1}, prompt_ids=(1,))  # type: ignore[arg-type]


def test_result_checks_lengths_and_finish_reason() -> None:
    result = GenerationResult(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -1.0],
                              text="x", finish_reason="stop")
    assert result.response_ids.dtype == np.int32 and result.logprobs.dtype == np.float32
    with pytest.raises(ValueError, match="logprobs length 1 != response_ids length 2"):
        GenerationResult(prompt_ids=[1], response_ids=[3, 4], logprobs=[-0.5], text="",
                         finish_reason="stop")
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult(prompt_ids=[1], response_ids=[3], logprobs=[-0.5], text="",
                         finish_reason="abort")  # type: ignore[arg-type]
