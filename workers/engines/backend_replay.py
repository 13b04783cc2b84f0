"""Replaying recorded responses through a real model: forced output with real logprobs.

:class:`ReplayBackend` answers each request with the next response of a recorded script (text
or token ids) instead of sampling, and scores it with a real model
(:meth:`TransformersBackend.score`), so the result carries the prompt ids the model would have
seen and the logprob the model gives each forced token under the request's sampling
distribution. Uses:

- re-scoring trajectories recorded elsewhere (another engine, a human demonstration, an
  imported dataset) under the current policy, to turn them into training samples;
- reproducing an episode exactly (a rollback regression, a bug report) with the real prompt
  rendering, tokenizer and model in the path.

Forced tokens outside the top-p nucleus get logprob ``-inf`` (the sampler could not have
produced them). A text response is tokenized without special tokens and, unless
``end_of_turn=False``, followed by the end-of-turn token ``<|im_end|>`` (finish reason "stop");
a response longer than the request's ``max_tokens`` is cut there (finish reason "length"), as
an engine would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from workers.engines.backend import FinishReason, GenerationRequest, GenerationResult
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.prompt import decode_response

__all__ = ["ReplayBackend"]


class ReplayBackend:
    """Forced-output backend over a real model (module docstring).

    ``scorer`` is the :class:`TransformersBackend` whose model and tokenizer score the
    responses; ``responses`` the script, consumed in order (strings or token-id sequences).
    Raises TypeError for a script entry that is neither. ``generate`` raises ValueError when
    the script is exhausted.
    """

    def __init__(self, scorer: TransformersBackend, responses: Iterable[str | Sequence[int]],
                 *, end_of_turn: bool = True) -> None:
        if not isinstance(scorer, TransformersBackend):
            raise TypeError(f"scorer must be a TransformersBackend, got {type(scorer).__name__}")
        script: list[str | list[int]] = []
        for index, response in enumerate(responses):
            if isinstance(response, str):
                script.append(response)
            elif isinstance(response, (Sequence, np.ndarray)) and not isinstance(
                    response, (bytes, bytearray)):
                script.append([int(i) for i in response])
            else:
                raise TypeError(f"responses[{index}] must be a str or a sequence of token ids, "
                                f"got {type(response).__name__}")
        self.scorer = scorer
        self.end_of_turn = end_of_turn
        self._script: deque[str | list[int]] = deque(script)
        self._used = 0
        self._end_id = scorer.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @property
    def policy_version(self) -> int:
        """The scorer's weights version."""
        return self.scorer.policy_version

    @property
    def tokenizer(self) -> object:
        """The scorer's tokenizer (what decodes its responses)."""
        return self.scorer.tokenizer

    @property
    def remaining(self) -> int:
        """How many recorded responses are left."""
        return len(self._script)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt ids the scorer renders for ``request``."""
        return self.scorer.prompt_ids(request)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """The next recorded response, scored by the model (module docstring). Raises
        TypeError for anything but a :class:`GenerationRequest`."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        if not self._script:
            raise ValueError(f"the replay script is exhausted after {self._used} responses")
        recorded = self._script.popleft()
        self._used += 1
        if isinstance(recorded, str):
            ids = list(self.scorer.tokenizer.encode(recorded, add_special_tokens=False))
            if self.end_of_turn:
                ids.append(self._end_id)
        else:
            ids = list(recorded)
        params = request.sampling
        finish: FinishReason = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        elif not ids or ids[-1] not in self.scorer.stop_token_ids:
            finish = "length"
        prompt = self.scorer.prompt_ids(request)
        logprobs = self.scorer.score(prompt, ids, temperature=params.temperature,
                                     top_p=params.top_p if not params.greedy else 1.0)
        text, _ = decode_response(self.scorer.tokenizer, ids)
        return GenerationResult(
            prompt_ids=np.asarray(prompt, dtype=np.int32),
            response_ids=np.asarray(ids, dtype=np.int32),
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            policy_version=self.scorer.policy_version,
        )
