"""The transformers backend on a CUDA device (skipped without one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_cuda_logprobs_match_recomputation_and_seeds_repeat(tiny_model_dir: Path) -> None:
    backend = TransformersBackend(tiny_model_dir, device="cuda")
    request = GenerationRequest(sampling=SamplingParams(temperature=0.8, top_p=0.9,
                                                        max_tokens=24, seed=4),
                                messages=({"role": "user", "content": "What is 3 * 5?"},))
    result = backend.generate(request)
    recomputed = backend.score(result.prompt_ids, result.response_ids, temperature=0.8,
                               top_p=0.9)
    np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
    assert np.array_equal(backend.generate(request).response_ids, result.response_ids)
