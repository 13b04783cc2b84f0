"""The generation backend seam: one method, ``generate(request) -> GenerationResult``.

Every backend (transformers, the vLLM offline engine, an OpenAI-compatible vLLM server, the
replay backend, later a remote trainer's completions endpoint) takes a
:class:`GenerationRequest` and returns a :class:`GenerationResult` carrying the prompt token ids
exactly as the engine saw them, the generated token ids and one log-probability per generated
token.

Log-probabilities, for every backend, are those of the sampled tokens under the *sampling
distribution*: ``log_softmax(logits / temperature)`` restricted to the top-p nucleus and
renormalised over it (vLLM's ``processed_logprobs`` mode). With ``top_p == 1`` this is the
temperature-scaled distribution a trainer recomputes. With ``temperature == 0`` (greedy) the
unscaled distribution ``log_softmax(logits)`` is used.

Backends that can take new weights also implement :class:`WeightUpdatable`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from store.validation import storable_text

if TYPE_CHECKING:
    import torch

__all__ = [
    "AsyncGenerationBackend",
    "FinishReason",
    "GenerationBackend",
    "GenerationRequest",
    "GenerationResult",
    "PromptRenderer",
    "SamplingParams",
    "WeightUpdatable",
]

FinishReason = Literal["stop", "length"]

_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters shared by all backends.

    ``temperature`` >= 0 (0 means greedy), ``0 < top_p <= 1``, ``max_tokens`` >= 1, ``seed`` an
    optional non-negative integer (same seed, same request, same weights: same output on the
    same backend), ``stop`` extra stop strings (the end-of-turn tokens always stop). Bad values
    raise ValueError naming the field and the value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ValueError(f"seed must be None or a non-negative integer, got {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a JSON-ready dict (as recorded in ``episode_started``)."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": list(self.stop),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a dict; unknown keys raise ValueError naming them."""
        if not isinstance(data, Mapping):
            raise TypeError(f"sampling params must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known: {list(_SAMPLING_KEYS)}")
        values = dict(data)
        if "stop" in values and values["stop"] is not None:
            values["stop"] = tuple(values["stop"])
        elif "stop" in values:
            values["stop"] = ()
        return cls(**values)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (validated like the constructor)."""
        values = self.to_dict()
        values.update(changes)
        return SamplingParams.from_dict(values)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: either ``prompt_ids`` or ``messages`` (+ optional ``tools``).

    ``messages`` are OpenAI-format chat messages rendered by the backend's chat template with
    the generation prompt appended; ``tools`` are OpenAI function schemas. Giving both or
    neither of ``prompt_ids`` and ``messages`` raises ValueError, as do empty prompts, negative
    ids and messages that are not dicts with a ``role``.
    """

    sampling: SamplingParams
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if (self.prompt_ids is None) == (self.messages is None):
            raise ValueError("exactly one of prompt_ids and messages must be given")
        if self.prompt_ids is not None:
            ids = tuple(int(i) for i in self.prompt_ids)
            if not ids:
                raise ValueError("prompt_ids must not be empty")
            negative = [i for i in ids if i < 0]
            if negative:
                raise ValueError(f"prompt_ids must be non-negative, got {negative[0]}")
            object.__setattr__(self, "prompt_ids", ids)
        if self.messages is not None:
            messages = tuple(self.messages)
            if not messages:
                raise ValueError("messages must not be empty")
            for index, message in enumerate(messages):
                if not isinstance(message, Mapping) or "role" not in message:
                    raise ValueError(f"messages[{index}] must be a dict with a 'role', "
                                     f"got {message!r}")
            object.__setattr__(self, "messages", messages)
        if self.tools is not None:
            tools = tuple(self.tools)
            for index, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tools[{index}] must be a dict, got {tool!r}")
            object.__setattr__(self, "tools", tools or None)


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """What a backend returns for one request.

    ``prompt_ids`` int32 ``(prompt_length,)`` as the engine saw them; ``response_ids`` int32
    ``(response_length,)`` including the end-of-turn token when generation stopped on it;
    ``logprobs`` float32 ``(response_length,)`` under the sampling distribution (module
    docstring); ``text`` the decoded response with control tokens removed and markup tokens
    (``<think>``, ``<tool_call>``…) kept, cut before a matched stop string; ``finish_reason``
    "stop" or "length"; ``policy_version`` the weights version that produced it.
    Mismatched lengths or an unknown finish reason raise ValueError.

    A NUL character in ``text`` (a model can sample the token of byte 0) becomes U+FFFD and a
    lone surrogate "?": the store refuses both in event payloads, and the token ids, which
    stay exact, are what training reads.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    finish_reason: FinishReason
    policy_version: int = 0

    def __post_init__(self) -> None:
        prompt = np.asarray(self.prompt_ids, dtype=np.int32).reshape(-1)
        response = np.asarray(self.response_ids, dtype=np.int32).reshape(-1)
        logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
        if response.shape != logprobs.shape:
            raise ValueError(f"logprobs length {logprobs.shape[0]} != response_ids length "
                             f"{response.shape[0]}")
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', "
                             f"got {self.finish_reason!r}")
        object.__setattr__(self, "text", storable_text(self.text))
        object.__setattr__(self, "prompt_ids", prompt)
        object.__setattr__(self, "response_ids", response)
        object.__setattr__(self, "logprobs", logprobs)


@runtime_checkable
class GenerationBackend(Protocol):
    """Anything that turns a :class:`GenerationRequest` into a :class:`GenerationResult`."""

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; bad requests raise ValueError naming the problem."""
        ...


@runtime_checkable
class AsyncGenerationBackend(Protocol):
    """A backend that serves concurrent requests from one event loop, generating the requests
    in flight together (continuous or padded batching)."""

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; bad requests raise ValueError naming the problem."""
        ...


@runtime_checkable
class PromptRenderer(Protocol):
    """A backend that renders prompts itself and can tell their token ids before generating
    (used to keep prompt + response within a token budget)."""

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt token ids the engine will see for ``request``."""
        ...


@runtime_checkable
class WeightUpdatable(Protocol):
    """A backend whose weights can be replaced in place (after a policy update)."""

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Load ``(name, tensor)`` pairs named as in the checkpoint; later results carry
        ``version``. Unknown names or mismatched shapes raise ValueError."""
        ...

