"""Generation with a plain ``transformers`` causal LM, on CPU or CUDA.

Sampling runs through ``model.generate`` with an explicit generation config built from the
request's :class:`~workers.engines.backend.SamplingParams` only (temperature, top-p, no top-k,
no repetition penalty: a model's own generation defaults are not merged in). The logprob of
each sampled token is read from the processed scores ``generate`` sampled from
(``output_scores``), i.e. the sampling distribution of :mod:`workers.engines.logprobs`.

A request with a seed is sampled row by row (:class:`_SeededRows`): its tokens depend on its
seed and its prompt, not on the other requests of its batch nor on torch's global generator,
so a rollout worker's concurrency, and which requests happen to share a padded batch, do not
change what is sampled (a difference of padding in the last bits of a logit can still flip a
near tie).

:meth:`TransformersBackend.score` recomputes the same logprobs with one teacher-forced forward
pass; it is also what the replay backend uses to score recorded responses.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from store.arguments import whole_number
from workers.engines.backend import FinishReason, GenerationRequest, GenerationResult
from workers.engines.batching import BatchScheduler
from workers.engines.logprobs import sampled_token_logprobs, sampling_log_softmax
from workers.engines.prompt import decode_response, end_of_turn_ids, render_prompt_ids
from workers.engines.transformers_lock import LOCK

__all__ = ["TransformersBackend"]

#: Neutral settings of the truncating warpers (used only when sampling).
_NEUTRAL_WARPERS: dict[str, Any] = {
    "top_k": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}
#: Neutral settings of the processors that also act on greedy decoding.
_NEUTRAL_PROCESSING: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
    "renormalize_logits": False,
}


def _batch_key(request: GenerationRequest) -> tuple[Any, ...]:
    """Requests with equal keys can share a padded batch; a request with stop strings is
    its own batch (its end is found by decoding, row by row)."""
    params = request.sampling
    if params.stop:
        return ("alone", id(request))
    return ("greedy",) if params.greedy else ("sample", params.temperature, params.top_p)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed torch's generators for the duration of the block without disturbing the caller's
    random state; no-op when ``seed`` is None."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class _SeededRows:
    """A ``generate`` logits processor that samples each row with a generator of its own.

    At every step it turns the row's logits into the log-probabilities of the sampling
    distribution (temperature and top-p, :func:`~workers.engines.logprobs.sampling_log_softmax`),
    keeps them, and adds Gumbel noise drawn from the row's generator (seeded with the row's
    seed); greedy decoding over the result draws each token from exactly that distribution
    (the Gumbel-max trick), with no use of the global generator. ``logprobs(tokens)`` gives
    the kept log-probabilities of the chosen tokens, ``(rows, steps)``."""

    def __init__(self, seeds: Sequence[int], *, temperature: float, top_p: float,
                 device: torch.device) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = sampling_log_softmax(scores, temperature=self.temperature, top_p=self.top_p)
        self.steps.append(logp)
        uniform = torch.stack([torch.rand(logp.shape[-1], generator=g, device=logp.device)
                               for g in self.generators])
        tiny = torch.finfo(uniform.dtype).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny, max=1.0 - 1e-7)))
        return logp + gumbel

    def logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        steps = min(len(self.steps), tokens.shape[1])
        if steps == 0:
            return torch.zeros((tokens.shape[0], 0))
        stacked = torch.stack(self.steps[:steps], dim=1)
        return stacked.gather(-1, tokens[:, :steps].unsqueeze(-1)).squeeze(-1)


def _seeded_rows(requests: Sequence[GenerationRequest], device: torch.device
                 ) -> _SeededRows | None:
    """The row-by-row sampler of ``requests`` when each is sampled (not greedy) with a
    seed; None otherwise (``generate`` samples with torch's generator)."""
    params = requests[0].sampling
    if params.greedy or any(r.sampling.seed is None for r in requests):
        return None
    return _SeededRows([int(r.sampling.seed) for r in requests if r.sampling.seed is not None],
                       temperature=params.temperature, top_p=params.top_p, device=device)


def _processors(rows: _SeededRows | None) -> Any:
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import LogitsProcessorList

    return LogitsProcessorList([rows] if rows is not None else [])


class _TokenStreamer:
    """A ``generate`` streamer (transformers' ``BaseStreamer`` protocol: ``put`` with the
    prompt first, then with each step's new token; ``end``) handing each new id to a
    callback."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self.on_token = on_token
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


class TransformersBackend:
    """A :class:`~workers.engines.backend.GenerationBackend` over a transformers causal LM.

    ``model`` is a folder path or an already loaded ``PreTrainedModel``; ``tokenizer`` defaults
    to the one saved beside a folder model (required when passing a loaded model). ``device``
    is "cpu" or "cuda[:n]"; ``dtype`` the weight dtype when loading from a folder;
    ``max_batch`` the most requests :meth:`agenerate` puts in one padded batch. ``generate``,
    the batches and ``update_weights`` take turns on one lock, so weights never change under
    a running batch. Bad arguments raise ValueError/TypeError naming them.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        *,
        tokenizer: Any | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        policy_version: int = 0,
        max_batch: int = 64,
    ) -> None:
        with LOCK:  # transformers' lazy names: one first use at a time
            from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

        self.device = torch.device(device)
        self.model: Any
        if isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isdir(path):
                raise ValueError(f"model folder {path!r} does not exist")
            with LOCK:  # transformers' lazy names: one first use at a time
                self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
                self.tokenizer = tokenizer if tokenizer is not None else (
                    AutoTokenizer.from_pretrained(path))
        elif isinstance(model, PreTrainedModel):
            if tokenizer is None:
                raise ValueError("tokenizer is required when model is a loaded PreTrainedModel")
            self.model = model
            self.tokenizer = tokenizer
        else:
            raise TypeError(f"model must be a folder path or a PreTrainedModel, "
                            f"got {type(model).__name__}")
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise TypeError(f"policy_version must be an integer, got {policy_version!r}")
        self.model.to(self.device)
        self.model.eval()
        self.policy_version = policy_version
        generation_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.stop_token_ids = end_of_turn_ids(self.tokenizer, generation_eos)
        self.pad_token_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id
                             is not None else self.stop_token_ids[0])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        whole_number("max_batch", max_batch)
        self.max_batch = max_batch
        self._engine_lock = threading.RLock()
        self._scheduler_lock = threading.Lock()
        self._scheduler: BatchScheduler | None = None

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids this backend feeds the model for ``request`` (see
        :func:`workers.engines.prompt.render_prompt_ids`)."""
        return render_prompt_ids(self.tokenizer, request)

    def generate(self, request: GenerationRequest,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Sample one response. Raises ValueError when the prompt does not fit the model's
        context (``max_position_embeddings``); ``max_tokens`` is capped to what fits.
        ``on_token`` is called with each generated id as it is sampled (from this thread);
        it does not change what is sampled."""
        with LOCK:  # transformers' lazy names: one first use at a time
            from transformers import GenerationConfig

        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        params = request.sampling
        prompt = self.prompt_ids(request)
        room = self.max_positions - len(prompt)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the model "
                             f"context of {self.max_positions}")
        max_new = min(params.max_tokens, room)
        rows = _seeded_rows([request], self.device)
        sampling: dict[str, Any] = {}
        if not params.greedy and rows is None:
            sampling = {"temperature": params.temperature, "top_p": params.top_p,
                        **_NEUTRAL_WARPERS}
        # ``generate`` fills every None field from the model's own generation config; the
        # neutral values below keep processors such as a checkpoint's top_k=20 or repetition
        # penalty out, so sampling follows exactly the documented distribution.
        config = GenerationConfig(
            do_sample=not params.greedy and rows is None,
            **sampling,
            **_NEUTRAL_PROCESSING,
            max_new_tokens=max_new,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            stop_strings=list(params.stop) or None,
            output_scores=True,
            return_dict_in_generate=True,
        )
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        with self._engine_lock, torch.inference_mode(), _seeded(params.seed, self.device):
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                tokenizer=self.tokenizer if params.stop else None,
                streamer=None if on_token is None else _TokenStreamer(on_token),
                logits_processor=_processors(rows),
            )
        response = output.sequences[0, len(prompt):]
        if rows is not None:
            logprobs = rows.logprobs(response.unsqueeze(0))[0]
        else:
            scores = torch.stack(output.scores, dim=1)[0, : response.shape[0]]  # (len, V)
            logprobs = scores.float().log_softmax(dim=-1).gather(
                -1, response.unsqueeze(-1)).squeeze(-1)
        response_ids = response.tolist()
        text, stopped_on_string = decode_response(self.tokenizer, response_ids,
                                                   stop=params.stop)
        ended = bool(response_ids) and response_ids[-1] in self.stop_token_ids
        finish: FinishReason = "stop" if ended or stopped_on_string else "length"
        return GenerationResult(
            prompt_ids=np.asarray(prompt, dtype=np.int32),
            response_ids=np.asarray(response_ids, dtype=np.int32),
            logprobs=logprobs.cpu().numpy().astype(np.float32),
            text=text,
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    def generate_batch(self, requests: Sequence[GenerationRequest]
                       ) -> list[GenerationResult]:
        """Sample one response per request with one padded ``generate`` call (prompts padded
        on the left). The requests must share temperature and top-p and have no stop strings
        (:meth:`agenerate` groups them so); each response is cut at its own end-of-turn token
        and its own ``max_tokens``. When every request has a seed, each row is sampled with
        its own (module docstring): a row's tokens do not depend on the batch it shared;
        otherwise the batch samples with torch's generator, seeded with the first seed given.
        Raises ValueError when the requests cannot share
        a batch or a prompt does not fit the model's context."""
        with LOCK:  # transformers' lazy names: one first use at a time
            from transformers import GenerationConfig

        requests = list(requests)
        if not requests:
            return []
        for request in requests:
            if not isinstance(request, GenerationRequest):
                raise TypeError(f"request must be a GenerationRequest, "
                                f"got {type(request).__name__}")
        if len(requests) == 1 or requests[0].sampling.stop:
            return [self.generate(request) for request in requests]
        keys = {_batch_key(request) for request in requests}
        if len(keys) > 1:
            raise ValueError(f"requests of one batch must share temperature and top_p and "
                             f"have no stop strings, got {sorted(map(str, keys))}")
        params = requests[0].sampling
        prompts = [self.prompt_ids(request) for request in requests]
        rooms = [self.max_positions - len(prompt) for prompt in prompts]
        if min(rooms) < 1:
            longest = max(len(prompt) for prompt in prompts)
            raise ValueError(f"prompt of {longest} tokens leaves no room in the model "
                             f"context of {self.max_positions}")
        caps = [min(request.sampling.max_tokens, room)
                for request, room in zip(requests, rooms, strict=True)]
        width = max(len(prompt) for prompt in prompts)
        max_new = min(max(caps), self.max_positions - width)
        caps = [min(cap, max_new) for cap in caps]
        rows = _seeded_rows(requests, self.device)
        sampling: dict[str, Any] = {}
        if not params.greedy and rows is None:
            sampling = {"temperature": params.temperature, "top_p": params.top_p,
                        **_NEUTRAL_WARPERS}
        config = GenerationConfig(
            do_sample=not params.greedy and rows is None, **sampling, **_NEUTRAL_PROCESSING,
            max_new_tokens=max_new, eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id, output_scores=True, return_dict_in_generate=True)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt):] = 1
        seed = next((r.sampling.seed for r in requests if r.sampling.seed is not None), None)
        with torch.inference_mode(), _seeded(seed, self.device):
            output = self.model.generate(input_ids=input_ids.to(self.device),
                                         attention_mask=attention.to(self.device),
                                         generation_config=config,
                                         logits_processor=_processors(rows))
        generated = output.sequences[:, width:]
        steps = len(output.scores)
        if rows is not None:
            logprobs_all = rows.logprobs(generated[:, :steps])
        else:
            logprobs_all = (torch.stack(output.scores, dim=1).float().log_softmax(dim=-1)
                            .gather(-1, generated[:, :steps].unsqueeze(-1)).squeeze(-1))
        results = []
        stops = set(self.stop_token_ids)
        for row, (prompt, cap) in enumerate(zip(prompts, caps, strict=True)):
            tokens = generated[row, :steps].tolist()
            end = next((i + 1 for i, token in enumerate(tokens) if token in stops),
                       len(tokens))
            end = min(end, cap)
            response_ids = tokens[:end]
            text, _ = decode_response(self.tokenizer, response_ids)
            ended = bool(response_ids) and response_ids[-1] in stops
            results.append(GenerationResult(
                prompt_ids=np.asarray(prompt, dtype=np.int32),
                response_ids=np.asarray(response_ids, dtype=np.int32),
                logprobs=logprobs_all[row, :end].cpu().numpy().astype(np.float32),
                text=text,
                finish_reason="stop" if ended else "length",
                policy_version=self.policy_version,
            ))
        return results

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate ``request`` together with the other requests in flight: a scheduler
        thread runs them in padded batches of up to ``max_batch``
        (:mod:`workers.engines.batching`; requests with stop strings run alone)."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        return await self.scheduler().submit(request)

    def scheduler(self) -> BatchScheduler:
        """The backend's batch scheduler (started on first use)."""
        with self._scheduler_lock:
            if self._scheduler is None or not self._scheduler.alive:
                self._scheduler = BatchScheduler(self._locked_batch, key=_batch_key,
                                                 max_batch=self.max_batch,
                                                 name="transformers")
            return self._scheduler

    def _locked_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        with self._engine_lock:
            return self.generate_batch(requests)

    def close(self) -> None:
        """Stop the batch scheduler (requests waiting in it fail)."""
        with self._scheduler_lock:
            if self._scheduler is not None:
                self._scheduler.close()
                self._scheduler = None

    def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> np.ndarray:
        """Teacher-forced logprobs ``(response_length,)`` float32 of ``response_ids`` after
        ``prompt_ids`` under the sampling distribution for ``temperature``/``top_p``.
        Raises ValueError for an empty prompt, ids outside the vocabulary or a sequence longer
        than the model's context."""
        prompt = [int(i) for i in prompt_ids]
        response = [int(i) for i in response_ids]
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt) + len(response) > self.max_positions:
            raise ValueError(f"sequence of {len(prompt) + len(response)} tokens exceeds the "
                             f"model context of {self.max_positions}")
        if not response:
            return np.zeros(0, dtype=np.float32)
        vocab = self.model.config.vocab_size
        bad = [i for i in prompt + response if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of size {vocab}")
        ids = torch.tensor([prompt + response], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0]  # (seq_len, V)
        predicting = logits[len(prompt) - 1 : len(prompt) + len(response) - 1]
        targets = torch.tensor(response, dtype=torch.long, device=self.device)
        logprobs = sampled_token_logprobs(predicting, targets, temperature=temperature,
                                          top_p=top_p)
        return logprobs.cpu().numpy().astype(np.float32)

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy ``(name, tensor)`` pairs into the model in place (names as in its state dict;
        a subset is fine) and set ``policy_version`` to ``version``. Raises ValueError for an
        unknown name or a shape mismatch, before any tensor is changed."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, got {version!r}")
        state = self.model.state_dict()
        pending = list(weights)
        for name, tensor in pending:
            if name not in state:
                raise ValueError(f"unknown weight name {name!r}")
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(state[name].shape)}")
        with self._engine_lock, torch.no_grad():
            for name, tensor in pending:
                state[name].copy_(tensor.to(device=state[name].device, dtype=state[name].dtype))
        self.policy_version = version
