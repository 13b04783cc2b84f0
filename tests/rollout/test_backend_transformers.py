"""The transformers backend on the tiny model: prompt ids, logprobs, seeds, stops, weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from workers.engines.backend import (
    GenerationBackend,
    GenerationRequest,
    SamplingParams,
    WeightUpdatable,
)
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.calculator import Calculator

MESSAGES = ({"role": "user", "content": "What is 12 * 7?"},)


def _request(**sampling: object) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(**sampling), messages=MESSAGES,
                             tools=(Calculator.schema,))


def test_backend_satisfies_the_protocols(hf_backend: TransformersBackend) -> None:
    assert isinstance(hf_backend, GenerationBackend)
    assert isinstance(hf_backend, WeightUpdatable)


def test_prompt_ids_are_the_rendered_chat_template(hf_backend: TransformersBackend) -> None:
    request = _request(max_tokens=4, seed=0)
    result = hf_backend.generate(request)
    expected = hf_backend.tokenizer.apply_chat_template(
        list(MESSAGES), tools=[Calculator.schema], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert result.prompt_ids.tolist() == list(expected)
    by_ids = hf_backend.generate(GenerationRequest(sampling=request.sampling,
                                                   prompt_ids=tuple(expected)))
    assert by_ids.prompt_ids.tolist() == list(expected)
    assert np.array_equal(by_ids.response_ids, result.response_ids)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.9, 0.8),
                                                    (0.0, 1.0)])
def test_logprobs_equal_a_forward_pass_recomputation(
        hf_backend: TransformersBackend, temperature: float, top_p: float) -> None:
    result = hf_backend.generate(_request(temperature=temperature, top_p=top_p,
                                          max_tokens=24, seed=5))
    assert result.response_ids.shape == result.logprobs.shape == (24,)
    assert result.finish_reason == "length"
    recomputed = hf_backend.score(result.prompt_ids, result.response_ids,
                                  temperature=temperature, top_p=top_p)
    np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
    assert np.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()


def test_seed_makes_sampling_reproducible(hf_backend: TransformersBackend) -> None:
    first = hf_backend.generate(_request(max_tokens=16, seed=11))
    second = hf_backend.generate(_request(max_tokens=16, seed=11))
    other = hf_backend.generate(_request(max_tokens=16, seed=12))
    assert np.array_equal(first.response_ids, second.response_ids)
    assert not np.array_equal(first.response_ids, other.response_ids)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.8)])
def test_seeded_rows_draw_from_the_sampling_distribution(temperature: float,
                                                         top_p: float) -> None:
    """The row-by-row sampler (Gumbel-max over the sampling distribution's log-probabilities)
    draws each token with its probability under temperature and top-p: 20,000 rows over a
    six-token vocabulary match the distribution within sampling error, and never leave the
    nucleus."""
    from workers.engines.backend_transformers import _SeededRows
    from workers.engines.logprobs import sampling_log_softmax

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    rows = _SeededRows(range(20_000), temperature=temperature, top_p=top_p,
                       device=torch.device("cpu"))
    drawn = rows(torch.zeros((20_000, 1), dtype=torch.long), logits.expand(20_000, -1))
    counts = torch.bincount(drawn.argmax(dim=-1), minlength=6).double() / 20_000
    expected = sampling_log_softmax(logits, temperature=temperature, top_p=top_p)[0].exp()
    error = (expected * (1 - expected) / 20_000).sqrt()
    assert ((counts - expected.double()).abs() <= 5 * error + 1e-9).all(), (counts, expected)
    assert float(counts[expected == 0].sum()) == 0.0


def test_seeded_batch_rows_keep_their_logprobs(hf_backend: TransformersBackend) -> None:
    """In a padded batch of seeded requests, each row's recorded log-probs are those of the
    tokens it drew, as one forward pass recomputes them, and the rows draw differently."""
    requests = [_request(temperature=0.8, top_p=0.9, max_tokens=12, seed=seed)
                for seed in range(4)]
    results = hf_backend.generate_batch(requests)
    for result in results:
        recomputed = hf_backend.score(result.prompt_ids, result.response_ids,
                                      temperature=0.8, top_p=0.9)
        np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
    assert len({r.response_ids.tobytes() for r in results}) > 1


def test_greedy_is_the_argmax_chain(hf_backend: TransformersBackend) -> None:
    result = hf_backend.generate(_request(temperature=0.0, max_tokens=6))
    ids = torch.tensor([result.prompt_ids.tolist()])
    for token in result.response_ids.tolist():
        with torch.no_grad():
            logits = hf_backend.model(input_ids=ids).logits[0, -1]
        assert int(logits.argmax()) == token
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def test_stop_string_ends_generation_and_cuts_text(hf_backend: TransformersBackend) -> None:
    free = hf_backend.generate(_request(temperature=0.0, max_tokens=30))
    text = free.text
    start = next(i for i in range(4, len(text) - 3)
                 if text.find(text[i:i + 3]) == i and text[i:i + 3].strip() == text[i:i + 3])
    stop = text[start:start + 3]
    stopped = hf_backend.generate(_request(temperature=0.0, max_tokens=30, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:start]
    assert stopped.response_ids.shape[0] < free.response_ids.shape[0]
    assert np.array_equal(stopped.response_ids, free.response_ids[:stopped.response_ids.shape[0]])


def test_update_weights_changes_outputs_and_version(tiny_model_dir: Path) -> None:
    backend = TransformersBackend(tiny_model_dir)
    before = backend.generate(_request(temperature=0.0, max_tokens=8))
    state = backend.model.state_dict()
    scaled = [(name, tensor * 4) for name, tensor in state.items() if "proj" in name]
    backend.update_weights(scaled, version=3)
    after = backend.generate(_request(temperature=0.0, max_tokens=8))
    assert after.policy_version == 3 and before.policy_version == 0
    assert not np.allclose(before.logprobs, after.logprobs)
    with pytest.raises(ValueError, match="unknown weight name 'nope'"):
        backend.update_weights([("nope", torch.zeros(1))], version=4)
    name = scaled[0][0]
    with pytest.raises(ValueError, match=f"weight '{name}' has shape"):
        backend.update_weights([(name, torch.zeros(2, 2, 2))], version=4)
    assert backend.policy_version == 3


def test_bad_inputs_are_named(hf_backend: TransformersBackend, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        TransformersBackend(tmp_path / "missing")
    with pytest.raises(TypeError, match="model must be"):
        TransformersBackend(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GenerationRequest"):
        hf_backend.generate({"prompt": "x"})  # type: ignore[arg-type]
    too_long = GenerationRequest(sampling=SamplingParams(),
                                 prompt_ids=tuple([5] * hf_backend.max_positions))
    with pytest.raises(ValueError, match="leaves no room"):
        hf_backend.generate(too_long)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf_backend.generate(GenerationRequest(sampling=SamplingParams(), prompt_ids=(10**6,)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf_backend.score([1, 2], [10**6])
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        hf_backend.score([], [1])


def test_model_generation_defaults_do_not_leak_into_sampling(tiny_model_dir: Path) -> None:
    backend = TransformersBackend(tiny_model_dir)
    backend.model.generation_config.top_k = 5
    backend.model.generation_config.repetition_penalty = 1.5
    backend.model.generation_config.min_p = 0.2
    for params in (SamplingParams(temperature=1.0, max_tokens=16, seed=1),
                   SamplingParams(temperature=0.0, max_tokens=16)):
        result = backend.generate(GenerationRequest(sampling=params, prompt_ids=(1, 5, 9)))
        recomputed = backend.score(result.prompt_ids, result.response_ids,
                                   temperature=params.temperature)
        np.testing.assert_allclose(result.logprobs, recomputed, atol=1e-4)
