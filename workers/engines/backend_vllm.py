"""Generation with vLLM's offline engine (``vllm.LLM``), in process.

Prompts are rendered here with the model's tokenizer and chat template and handed to the
engine as token ids (``TokensPrompt``), so ``prompt_ids`` are exactly what the engine consumed.
The engine is created with ``logprobs_mode="processed_logprobs"``: the logprob of a sampled
token is taken after temperature scaling and top-p truncation, i.e. under the sampling
distribution defined in :mod:`workers.engines.backend`, the same quantity the transformers
backend reports. Weights are replaced in place with the worker's ``reload_weights`` followed by
a prefix-cache reset (cached key/values of the old weights must not be reused).

:func:`cpu_engine_environment` gives the environment for a small in-process CPU engine (no
engine subprocess, eager mode, a bounded KV cache); it must be applied before ``vllm`` is first
imported.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from store.arguments import whole_number
from workers.engines.backend import FinishReason, GenerationRequest, GenerationResult
from workers.engines.batching import EngineStopped
from workers.engines.prompt import end_of_turn_ids, render_prompt_ids
from workers.engines.transformers_lock import LOCK

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncVLLMBackend", "VLLMBackend", "cpu_engine_environment", "vllm_available"]


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported."""
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install counts as unavailable
        return False
    return True


def cpu_engine_environment(cache_root: str | os.PathLike[str], *, kv_cache_gib: int = 1
                           ) -> dict[str, str]:
    """Environment variables for an in-process vLLM CPU engine: single process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a KV cache of ``kv_cache_gib`` GiB and vLLM's
    compile/cache files under ``cache_root``. Raises ValueError when ``kv_cache_gib`` < 1."""
    whole_number("kv_cache_gib", kv_cache_gib)
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": os.fspath(cache_root),
    }


def _engine_folder(model: str | os.PathLike[str], policy_version: object,
                   engine_kwargs: dict[str, Any]) -> str:
    """The model folder of an engine, after the checks both vLLM backends make: the folder
    exists, ``logprobs_mode`` is left to the backend, ``policy_version`` is an integer."""
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ValueError(f"model folder {path!r} does not exist")
    if "logprobs_mode" in engine_kwargs:
        raise ValueError("logprobs_mode is fixed to 'processed_logprobs' by this backend")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise TypeError(f"policy_version must be an integer, got {policy_version!r}")
    return path


class VLLMBackend:
    """A :class:`~workers.engines.backend.GenerationBackend` over ``vllm.LLM``.

    ``model`` is a model folder; ``engine_kwargs`` go to ``vllm.LLM`` (e.g.
    ``distributed_executor_backend="uni", enforce_eager=True, dtype="float32",
    max_model_len=2048``); ``logprobs_mode`` is fixed to "processed_logprobs". Raises
    ValueError when the folder does not exist or ``engine_kwargs`` sets ``logprobs_mode``.
    """

    #: The engine runs on the thread that built it (vLLM's CPU attention checks its OpenMP
    #: thread count per call): the agent loop calls it on its own thread.
    bound_to_its_thread = True

    def __init__(self, model: str | os.PathLike[str], *, policy_version: int = 0,
                 **engine_kwargs: Any) -> None:
        path = _engine_folder(model, policy_version, engine_kwargs)
        from vllm import LLM

        self.llm = LLM(model=path, tokenizer=path, logprobs_mode="processed_logprobs",
                       **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = end_of_turn_ids(self.tokenizer)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.policy_version = policy_version

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids this backend sends the engine for ``request``."""
        return render_prompt_ids(self.tokenizer, request)

    def _sampling(self, request: GenerationRequest, prompt_length: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        params = request.sampling
        room = self.max_model_len - prompt_length
        if room < 1:
            raise ValueError(f"prompt of {prompt_length} tokens leaves no room in the model "
                             f"context of {self.max_model_len}")
        return VllmSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_tokens=min(params.max_tokens, room),
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=self.stop_token_ids,
            logprobs=0,
            skip_special_tokens=True,
        )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Sample one response (see :meth:`generate_batch`)."""
        return self.generate_batch([request])[0]

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample one response per request in one engine step loop (continuous batching).
        Raises ValueError when a prompt does not fit the model context."""
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for request in requests:
            if not isinstance(request, GenerationRequest):
                raise TypeError(f"request must be a GenerationRequest, "
                                f"got {type(request).__name__}")
            ids = self.prompt_ids(request)
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(self._sampling(request, len(ids)))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for prompt, output in zip(prompts, outputs, strict=True):
            completion = output.outputs[0]
            token_ids = [int(t) for t in completion.token_ids]
            if completion.logprobs is None:  # _sampling always asks for them
                raise RuntimeError("vLLM returned no log-probs for a request that asked for them")
            logprobs = [float(completion.logprobs[i][token].logprob)
                        for i, token in enumerate(token_ids)]
            finish: FinishReason = ("length" if completion.finish_reason == "length"
                                    else "stop")
            results.append(GenerationResult(
                prompt_ids=np.asarray(prompt["prompt_token_ids"], dtype=np.int32),
                response_ids=np.asarray(token_ids, dtype=np.int32),
                logprobs=np.asarray(logprobs, dtype=np.float32),
                text=completion.text,
                finish_reason=finish,
                policy_version=self.policy_version,
            ))
        return results

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
                       ) -> None:
        """Load ``(name, tensor)`` pairs (checkpoint names) into the engine in place, reset the
        prefix cache and set ``policy_version``. Raises TypeError for a non-integer
        ``version``; the engine raises for names it does not know."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, got {version!r}")
        pending = list(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pending)})
        self.llm.reset_prefix_cache()
        self.policy_version = version


def _sampling_params(params: Any, *, room: int, stop_token_ids: list[int]) -> Any:
    """vLLM sampling parameters for our :class:`SamplingParams` with ``room`` tokens left."""
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=0,
        max_tokens=min(params.max_tokens, room), seed=params.seed,
        stop=list(params.stop) or None, stop_token_ids=stop_token_ids, logprobs=0,
        skip_special_tokens=True)


class AsyncVLLMBackend:
    """A batching backend over vLLM's async engine (``AsyncLLM``): every request in flight,
    from any number of concurrent episodes, joins the engine's continuous batch.

    The engine runs its own event loop in a thread of this process (the engine core itself is
    a child process of vLLM's), so :meth:`agenerate` can be awaited from any event loop and
    :meth:`generate` called from any thread. Prompts are rendered here and sent as token ids,
    logprobs are ``processed_logprobs`` as for :class:`VLLMBackend`. Weights are replaced by
    writing them to a safetensors file that the engine's workers reload in place
    (``reload_weights(weights_path=...)``), then the prefix cache is reset.

    When the engine dies, requests in flight fail with the engine's error and later ones
    with :class:`~workers.engines.batching.EngineStopped`; :attr:`dead` says why, and the
    rollout worker builds a new engine for its next group. ``engine_kwargs`` go to
    ``AsyncEngineArgs``. Raises ValueError when the folder does not exist or
    ``engine_kwargs`` sets ``logprobs_mode``.
    """

    def __init__(self, model: str | os.PathLike[str], *, policy_version: int = 0,
                 **engine_kwargs: Any) -> None:
        path = _engine_folder(model, policy_version, engine_kwargs)
        with LOCK:  # transformers' lazy names: one first use at a time
            from transformers import AutoTokenizer

        with LOCK:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_token_ids = end_of_turn_ids(self.tokenizer)
        self.policy_version = policy_version
        self.dead: str | None = None
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async",
                                        daemon=True)
        self._thread.start()
        self.engine = self._call(self._start(path, engine_kwargs))
        self.max_model_len = int(self.engine.model_config.max_model_len)

    async def _start(self, path: str, engine_kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=path, tokenizer=path, logprobs_mode="processed_logprobs", **engine_kwargs))

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids this backend sends the engine for ``request``."""
        return render_prompt_ids(self.tokenizer, request)

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        from vllm.inputs import TokensPrompt

        if self.dead is not None:
            raise EngineStopped(f"the vLLM engine is dead: {self.dead}")
        ids = self.prompt_ids(request)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the model "
                             f"context of {self.max_model_len}")
        params = _sampling_params(request.sampling, room=room,
                                  stop_token_ids=self.stop_token_ids)
        version = self.policy_version
        final = None
        try:
            async for output in self.engine.generate(TokensPrompt(prompt_token_ids=ids),
                                                     params, f"r{next(self._ids)}"):
                final = output
        except Exception as exc:
            if getattr(self.engine, "errored", False):
                self.dead = f"{type(exc).__name__}: {exc}"
            raise
        if final is None:
            raise EngineStopped("the vLLM engine returned no output")
        completion = final.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        logprobs = [float(completion.logprobs[i][token].logprob)
                    for i, token in enumerate(token_ids)]
        finish: FinishReason = "length" if completion.finish_reason == "length" else "stop"
        return GenerationResult(
            prompt_ids=np.asarray(ids, dtype=np.int32),
            response_ids=np.asarray(token_ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32), text=completion.text,
            finish_reason=finish, policy_version=version)

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate ``request`` in the engine's continuous batch (awaitable from any loop).
        Raises ValueError for a prompt that does not fit the context and
        :class:`~workers.engines.batching.EngineStopped` once the engine is dead."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        if self.dead is not None:
            raise EngineStopped(f"the vLLM engine is dead: {self.dead}")
        future = asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)
        return await asyncio.wrap_future(future)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one request, blocking (from a thread that is not the engine's)."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        if self.dead is not None:
            raise EngineStopped(f"the vLLM engine is dead: {self.dead}")
        return self._call(self._generate(request))

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate all ``requests`` together and return their results in order."""
        async def every() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self._generate(r) for r in requests)))

        return self._call(every())

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
                       ) -> None:
        """Load ``(name, tensor)`` pairs (checkpoint names) into the engine in place (through
        a safetensors file the engine's workers read), reset the prefix cache and set
        ``policy_version``. Call it with no request in flight (the rollout runtime's weights
        gate sees to that). Raises TypeError for a non-integer ``version``."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, got {version!r}")
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in weights}
        with tempfile.TemporaryDirectory(prefix="trajstore-weights-") as folder:
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            self.update_weights_from(folder, version=version)

    def update_weights_from(self, folder: str | os.PathLike[str], *, version: int) -> None:
        """Reload the weights in place from the safetensors files of ``folder``, reset the
        prefix cache and set ``policy_version``."""
        async def reload() -> None:
            await self.engine.collective_rpc(
                "reload_weights", kwargs={"weights_path": os.fspath(folder)})
            await self.engine.reset_prefix_cache()

        self._call(reload())
        self.policy_version = version

    def close(self) -> None:
        """Shut the engine down and stop its loop."""
        self.dead = self.dead or "the engine was closed"
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.shutdown()
                del engine  # collected now, while the interpreter is whole
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
