"""Training samples: one per surviving timeline.

A sample is the timeline's tokens with a loss mask that is 1 exactly on the tokens the model
sampled, the rollout logprobs of those tokens (0.0 elsewhere), and a prompt/response split at
the first trainable token, so a trainer that wants ``(prompt, response)`` pairs gets the
context before the first generation as the prompt and everything after it (later context
included, masked out) as the response.
"""

from __future__ import annotations

from dataclasses import dataclass

from store.arguments import whole_number
from workers.replay.timeline import Timeline, loss_mask

__all__ = ["Sample", "build_sample", "rollout_logprobs"]


def rollout_logprobs(timeline: Timeline) -> list[float]:
    """Per-token rollout logprobs of ``timeline``: the recorded logprob on sampled tokens,
    0.0 everywhere else. Raises TypeError when ``timeline`` is not a ``Timeline``."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    out: list[float] = []
    for m in timeline.messages:
        out.extend(m.token_logprobs())
    return out


@dataclass(frozen=True)
class Sample:
    """One training sequence.

    ``token_ids``, ``loss_mask`` and ``logprobs`` have one entry per token, shape
    ``(num_tokens,)``; ``prompt_length`` is the index of the first trainable token
    (``num_tokens`` when there is none). Counts: messages, ``llm`` turns, tokens, trainable
    tokens, drifted messages. ``timeline_index`` is the recording index of the timeline the
    sample came from; ``reward`` is the episode's reward when known.
    """

    agent: str
    timeline_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    num_messages: int
    num_llm_turns: int
    num_tokens: int
    num_trainable_tokens: int
    num_drifted_messages: int = 0
    reward: float | None = None

    @property
    def prompt_ids(self) -> list[int]:
        """Tokens before the first trainable token, shape ``(prompt_length,)``."""
        return self.token_ids[: self.prompt_length]

    @property
    def response_ids(self) -> list[int]:
        """Tokens from the first trainable token on, shape ``(response_length,)``."""
        return self.token_ids[self.prompt_length:]

    @property
    def response_mask(self) -> list[int]:
        """Loss mask of the response part, shape ``(response_length,)``."""
        return self.loss_mask[self.prompt_length:]

    @property
    def response_logprobs(self) -> list[float]:
        """Rollout logprobs of the response part, shape ``(response_length,)``."""
        return self.logprobs[self.prompt_length:]


def build_sample(timeline: Timeline, *, timeline_index: int = 0, drifted_messages: int = 0,
                 reward: float | None = None) -> Sample:
    """The training sample of ``timeline``. Raises TypeError when ``timeline`` is not a
    ``Timeline`` and ValueError when ``timeline_index`` or ``drifted_messages`` is negative
    or ``reward`` is not a finite number."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    for name, value in (("timeline_index", timeline_index),
                        ("drifted_messages", drifted_messages)):
        whole_number(name, value, minimum=0)
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
                or reward != reward or reward in (float("inf"), float("-inf")):
            raise ValueError(f"reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    ids = timeline.token_ids
    mask = loss_mask(timeline)
    try:
        first = mask.index(1)  # the mask holds only 0 and 1
    except ValueError:
        first = len(mask)
    return Sample(
        agent=timeline.agent,
        timeline_index=timeline_index,
        token_ids=ids,
        loss_mask=mask,
        logprobs=rollout_logprobs(timeline),
        prompt_length=first,
        num_messages=len(timeline.messages),
        num_llm_turns=sum(1 for m in timeline.messages if m.is_llm),
        num_tokens=len(ids),
        num_trainable_tokens=sum(mask),
        num_drifted_messages=drifted_messages,
        reward=reward,
    )
