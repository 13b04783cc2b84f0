"""A generation's text is storable whatever the model sampled."""

from __future__ import annotations

import numpy as np

from workers.engines.backend import GenerationResult


def test_nul_and_lone_surrogates_become_storable_text_with_exact_ids() -> None:
    ids = np.array([0, 97, 0], dtype=np.int32)
    result = GenerationResult(prompt_ids=np.array([1]), response_ids=ids,
                              logprobs=np.zeros(3), text="\x00a\ud800\x00",
                              finish_reason="stop")
    assert result.text == "\ufffda?\ufffd"
    assert result.response_ids.tolist() == [0, 97, 0]
    plain = GenerationResult(prompt_ids=np.array([1]), response_ids=ids, logprobs=np.zeros(3),
                             text="ok", finish_reason="length")
    assert plain.text == "ok"


def test_a_tool_output_with_nul_is_storable() -> None:
    from workers.rollout.tools import ToolOutcome

    outcome = ToolOutcome.error("ValueError", "bad\x00byte", output="x\x00y")
    assert (outcome.output, outcome.error_message) == ("x\ufffdy", "bad\ufffdbyte")
