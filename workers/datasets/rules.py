"""The rules a dataset is derived under, as one validated model (``DatasetRules``).

Every rule has a default that reproduces the run's own projection (the run's merge policy,
its negative-sample settings, the latest recorded reward, every sampled token trained), so a
rule that is not stated changes nothing. Rules are compared and hashed in their canonical
form (``canonical``): every field, defaults included, as sorted JSON.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["AdvantageRule", "DatasetRules", "FilterRule", "MergeRule", "NegativeRule",
           "RewardRule", "TrainRule", "canonical", "check_name", "load_reward_function"]

_FUNCTION = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
#: Names the REST paths use for themselves.
RESERVED_NAMES = ("diff",)


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RewardRule(_Rule):
    """Where a row's reward comes from. ``function``: ``"pkg.mod:func"``, called with the
    episode (``workers.datasets.build.Episode``) and returning a finite number; otherwise
    the episode's latest ``reward_assigned`` (of ``source`` only, when given: a grader's
    name as the event records it). An episode without such a reward is left out
    (``no_reward``): no reward is invented."""

    function: str | None = None
    source: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("function")
    @classmethod
    def _function(cls, value: str | None) -> str | None:
        if value is not None and not _FUNCTION.match(value):
            raise ValueError(f"must look like 'package.module:function', got {value!r}")
        return value

    @model_validator(mode="after")
    def _one(self) -> RewardRule:
        if self.function is not None and self.source is not None:
            raise ValueError("give a reward function or a recorded reward source, not both")
        return self


class MergeRule(_Rule):
    """The merge level (``text`` or ``token``) and whether tool lists are ignored; None: the
    run's own."""

    compare_level: Literal["text", "token"] | None = None
    ignore_tools: bool | None = None


class NegativeRule(_Rule):
    """Negative samples: whether they are kept, at most ``cap`` per GRPO group (earliest
    failure first), with ``reward``; None: the run's own settings."""

    enabled: bool | None = None
    cap: int | None = Field(default=None, ge=0)
    reward: float | None = Field(default=None, allow_inf_nan=False)


class TrainRule(_Rule):
    """What is trained: ``turns`` ``all`` (every sampled token) or ``last`` (only the
    tokens of each sample's last trainable LLM turn; mask and logprobs are 0 elsewhere);
    ``agents``: only the samples of these agents (None: every agent). A sample left with
    no trainable token is left out."""

    turns: Literal["all", "last"] = "all"
    agents: tuple[str, ...] | None = Field(default=None, min_length=1)


class FilterRule(_Rule):
    """Which episodes: ``statuses`` (of ``episode_finished``), ``tasks`` (task ids),
    ``min_version`` / ``max_version`` (the policy version of the episode's last LLM call,
    inclusive), ``error_types`` (episodes that met at least one of these error types, in a
    tool result or a failed attempt). None: no filter."""

    statuses: tuple[Literal["completed", "terminated", "truncated", "error", "aborted"],
                    ...] | None = Field(default=None, min_length=1)
    tasks: tuple[str, ...] | None = Field(default=None, min_length=1)
    min_version: int | None = Field(default=None, ge=0)
    max_version: int | None = Field(default=None, ge=0)
    error_types: tuple[str, ...] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _range(self) -> FilterRule:
        if self.min_version is not None and self.max_version is not None \
                and self.min_version > self.max_version:
            raise ValueError(f"min_version {self.min_version} is above max_version "
                             f"{self.max_version}")
        return self


class AdvantageRule(_Rule):
    """Advantages over each GRPO group's rollout-level units, as the trainer computes them
    (``workers.trainer.egpo.grpo_scalar_advantages`` with ``units``): an episode counts
    once, every kept negative sample is a unit of its own; ``grpo`` is
    ``(r - mean) / (std + 1e-6)`` with the unbiased std (a singleton group: mean 0, std 1),
    ``norm_by_std`` False drops the division. None: no advantage."""

    kind: Literal["grpo"] = "grpo"
    norm_by_std: bool = True


class DatasetRules(_Rule):
    """Every rule of a derivation (see each part). Raises pydantic's ValidationError naming
    the field for a value out of range or an unknown field."""

    reward: RewardRule = RewardRule()
    merge: MergeRule = MergeRule()
    negatives: NegativeRule = NegativeRule()
    train: TrainRule = TrainRule()
    filters: FilterRule = FilterRule()
    advantage: AdvantageRule | None = None


def canonical(rules: DatasetRules) -> str:
    """``rules`` as sorted, compact JSON with every field (what is hashed and stored)."""
    return json.dumps(rules.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def check_name(name: str) -> str:
    """``name`` when it can name a dataset (1 to 100 letters, digits, ``.``, ``_``, ``-``,
    not starting with a punctuation mark; not ``diff``). Raises ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED_NAMES:
        raise ValueError(f"a dataset name is 1 to 100 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit (and not 'diff'), got {name!r}")
    return name


def load_reward_function(spec: str) -> Callable[[Any], Any]:
    """The function ``"pkg.mod:func"`` names. Raises ValueError when the module cannot be
    imported or has no such callable."""
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # the module's own import error, whatever it is
        raise ValueError(f"reward function {spec!r}: module {module_name!r} cannot be "
                         f"imported ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward function {spec!r} is not callable")
    return target  # type: ignore[no-any-return]
