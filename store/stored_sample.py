"""The one type of a training sample read back from the ``samples`` table.

Projections write samples (``store.projections.SampleRow``); leasing hands them to trainers,
and the API's sample listings, lease answers and exports read them. All of those readers get a
``StoredSample``, decoded from a row by ``from_row`` with the byte layout of ``store.codec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from store.codec import unpack_ids, unpack_logprobs, unpack_mask

__all__ = ["StoredSample", "from_row"]


@dataclass(frozen=True)
class StoredSample:
    """One sample. Arrays have one entry per token, shape ``(num_tokens,)``; the prompt is
    the first ``prompt_length`` tokens. A row read without its token columns has
    ``token_ids`` of zeros (the right length) and empty ``loss_mask`` and ``logprobs``."""

    sample_id: int
    run_id: str
    group_id: str
    episode_id: str
    agent: str
    kind: str
    # The episode's latest reward (a negative sample: the run's negative reward); None for a
    # sample of an episode that has none yet (status ``no_reward``), never made a number.
    reward: float | None
    policy_version: int | None
    prompt_length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    status: str | None = None
    num_trainable: int | None = None
    error_types: Sequence[str] | None = None
    error_messages: Sequence[str] | None = None

    @property
    def uid(self) -> str:
        """The GRPO group, under the name verl gives it."""
        return self.group_id

    @property
    def is_negative(self) -> bool:
        return self.kind == "negative"

    @property
    def prompt_ids(self) -> np.ndarray:
        """Tokens before the first trainable one, shape ``(prompt_length,)``."""
        return self.token_ids[: self.prompt_length]

    @property
    def response_ids(self) -> np.ndarray:
        """Tokens from the first trainable one on, shape ``(response_length,)``."""
        return self.token_ids[self.prompt_length :]

    @property
    def response_mask(self) -> np.ndarray:
        """1 where a response token is trained (sampled by the model), shape
        ``(response_length,)``."""
        return self.loss_mask[self.prompt_length :]

    @property
    def rollout_logprobs(self) -> np.ndarray:
        """The engine's logprobs of the response tokens (0 where not sampled)."""
        return self.logprobs[self.prompt_length :]


Sample = TypeVar("Sample", bound="StoredSample")


def from_row(row: Mapping[str, Any], *, as_type: type[Sample] = StoredSample,  # type: ignore[assignment]
             **overrides: Any) -> Sample:
    """A sample from a ``samples`` row (a mapping of its columns, token columns as bytes),
    of ``as_type`` (``StoredSample`` or a subclass: leasing's ``LeasedSample``).
    ``overrides`` replace fields (leasing sets ``status``). Raises ``ValueError`` when a token
    column is not a whole number of its elements (a truncated payload)."""
    if "token_ids" in row:
        ids = unpack_ids(row["token_ids"])
        mask = unpack_mask(row["loss_mask"])
        logprobs = unpack_logprobs(row["logprobs"])
    else:
        ids = np.zeros(row["num_tokens"], dtype=np.int32)
        mask = np.zeros(0, dtype=np.uint8)
        logprobs = np.zeros(0, dtype=np.float32)
    fields: dict[str, Any] = {
        "sample_id": row["sample_id"], "run_id": row.get("run_id", ""),
        "group_id": row["group_id"], "episode_id": row["episode_id"], "agent": row["agent"],
        "kind": row["kind"], "reward": row["reward"], "policy_version": row["policy_version"],
        "prompt_length": row["prompt_length"], "token_ids": ids, "loss_mask": mask,
        "logprobs": logprobs, "status": row.get("status"),
        "num_trainable": row.get("num_trainable"), "error_types": row.get("error_types"),
        "error_messages": row.get("error_messages"),
    }
    fields.update(overrides)
    return as_type(**fields)
