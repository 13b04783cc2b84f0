"""The replay backend: forced responses scored by the real tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend

MESSAGES = ({"role": "user", "content": "Say hi."},)


def _request(**sampling: object) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(**sampling), messages=MESSAGES)


def test_text_is_forced_with_end_of_turn_and_scored(hf_backend: TransformersBackend) -> None:
    replay = ReplayBackend(hf_backend, ["<think>\nok\n</think>\n\nhi there"])
    result = replay.generate(_request(temperature=0.8))
    tokenizer = hf_backend.tokenizer
    expected = tokenizer.encode("<think>\nok\n</think>\n\nhi there", add_special_tokens=False)
    assert result.response_ids.tolist() == expected + [tokenizer.convert_tokens_to_ids(
        "<|im_end|>")]
    assert result.finish_reason == "stop"
    assert result.text == "<think>\nok\n</think>\n\nhi there"
    assert result.prompt_ids.tolist() == hf_backend.prompt_ids(_request())
    np.testing.assert_allclose(
        result.logprobs,
        hf_backend.score(result.prompt_ids, result.response_ids, temperature=0.8), atol=1e-6)
    assert replay.remaining == 0


def test_token_ids_and_truncation_at_max_tokens(hf_backend: TransformersBackend) -> None:
    replay = ReplayBackend(hf_backend, [[40, 41, 42, 43, 44], [40, 41]])
    cut = replay.generate(_request(max_tokens=3))
    assert cut.response_ids.tolist() == [40, 41, 42] and cut.finish_reason == "length"
    unfinished = replay.generate(_request())
    assert unfinished.finish_reason == "length"  # no end-of-turn token: not a finished turn


def test_forced_tokens_outside_the_nucleus_have_minus_infinity(
        hf_backend: TransformersBackend) -> None:
    prompt = hf_backend.prompt_ids(_request())
    first_token = [hf_backend.score(prompt, [token])[0] for token in range(60)]
    unlikely = int(np.argmin(first_token))
    narrow = ReplayBackend(hf_backend, [[unlikely]]).generate(_request(top_p=0.05))
    assert np.isneginf(narrow.logprobs[0])
    wide = ReplayBackend(hf_backend, [[unlikely]]).generate(_request(top_p=1.0))
    assert wide.logprobs[0] == pytest.approx(first_token[unlikely], abs=1e-6)


def test_exhausted_script_and_bad_entries(hf_backend: TransformersBackend) -> None:
    replay = ReplayBackend(hf_backend, ["a"])
    replay.generate(_request())
    with pytest.raises(ValueError, match="exhausted after 1 responses"):
        replay.generate(_request())
    with pytest.raises(TypeError, match=r"responses\[1\]"):
        ReplayBackend(hf_backend, ["a", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="scorer"):
        ReplayBackend(object(), ["a"])  # type: ignore[arg-type]
