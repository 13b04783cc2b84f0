"""The temperature a sample is scored at: the one it was sampled at.

The engines report each sampled token's log-prob under the *sampling* distribution,
``log_softmax(logits / T)`` (``workers.engines.backend``). The trainer's old log-probs must be
taken under the same ``T``, or even a zero-staleness sample gets importance ratios other than
1 (``exp(log pi_T - log pi_1)``) and its PPO ratio starts away from 1.

``T`` of a sample, first found of:

1. ``TrainerConfig.temperature`` when set: an explicit override for every sample (logged by
   the trainer and counted in the step's metrics);
2. the ``temperature`` its episode recorded in ``episode_started.sampling_params`` (the agent
   loop records its sampling parameters there; REST clients and remote rollouts may);
3. the run's ``RunConfig.rollout.temperature`` (what the run's rollout workers sample at).

A sampling temperature of 0 (greedy) is scored at 1: for greedy decoding the engines report
the unscaled ``log_softmax(logits)``. A recorded value that is not a finite number >= 0 is
ignored (the run's temperature is used) and counted.

Top-p below 1 is not reproduced: the engines renormalise over the nucleus, the trainer scores
the whole vocabulary, as verl does; such a run's ratios sit slightly below 1 on-policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from store.events import RunConfig

__all__ = ["recorded_temperature", "scoring_temperature", "scoring_temperatures"]


def recorded_temperature(sampling_params: Mapping[str, Any] | None) -> float | None:
    """The ``temperature`` of an episode's recorded sampling parameters when it is a finite
    number >= 0 (a boolean is not), else None."""
    value = (sampling_params or {}).get("temperature")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def scoring_temperature(sampling: float) -> float:
    """The temperature to divide the logits by for a sample drawn at ``sampling``: itself,
    or 1 for greedy decoding (``sampling == 0``). Raises ValueError for a negative or
    non-finite ``sampling``."""
    if isinstance(sampling, bool) or not isinstance(sampling, int | float) or not (
            math.isfinite(sampling) and sampling >= 0):
        raise ValueError(f"a sampling temperature must be a finite number >= 0, got "
                         f"{sampling!r}")
    return 1.0 if sampling == 0 else float(sampling)


def scoring_temperatures(episode_ids: Sequence[str],
                         recorded: Mapping[str, Mapping[str, Any]], run_config: RunConfig, *,
                         override: float | None = None
                         ) -> tuple[tuple[float, ...], dict[str, float]]:
    """The scoring temperature of each row (its episode id in ``episode_ids``; ``recorded``
    maps episode ids to their recorded sampling parameters, as
    ``store.queries.episode_sampling_params`` reads them), following the module docstring's
    order, and the step's metrics: ``scoring_temperature_min``/``_max``,
    ``scoring_temperature_override`` (1 when ``override`` decided) and
    ``scoring_temperature_unrecorded`` (rows whose episode recorded no usable temperature,
    scored at the run's). Raises ValueError for an ``override`` that is not a finite number
    > 0 (and as :func:`scoring_temperature`)."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int | float) or not (
                math.isfinite(override) and override > 0):
            raise ValueError(f"override must be a finite number > 0, got {override!r}")
        temps = tuple(float(override) for _ in episode_ids)
        unrecorded = 0
    else:
        run_default = scoring_temperature(run_config.rollout.temperature)
        found = [recorded_temperature(recorded.get(str(e))) for e in episode_ids]
        temps = tuple(run_default if t is None else scoring_temperature(t) for t in found)
        unrecorded = sum(t is None for t in found)
    metrics = {"scoring_temperature_override": float(override is not None),
               "scoring_temperature_unrecorded": float(unrecorded)}
    if temps:
        metrics.update(scoring_temperature_min=min(temps), scoring_temperature_max=max(temps))
    return temps, metrics
