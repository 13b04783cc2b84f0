"""A run configuration accepted at creation never fails training later: for EGPO's forms, the
off-policy correction, the rollout temperature and the negative reward, what ``RunConfig``
accepts is exactly what the trainer's functions run with, and what it refuses names the
field."""

from __future__ import annotations

import math
import random
import uuid
from typing import Any

import numpy as np
import pytest
import torch
import trainer_episodes
from pydantic import ValidationError

from store.eventlog import NO_STREAM, run_stream_id
from store.events import REJECTION_MODES, EgpoConfig, RunConfig, RunCreated
from store.stored_sample import StoredSample
from workers.trainer.advantages import ADVANTAGE_ESTIMATORS, AdvantageSettings
from workers.trainer.batch import pad_samples
from workers.trainer.correction import bypass_policy_loss, compute_correction
from workers.trainer.temperature import scoring_temperatures

trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

S, E = 151667, 151668


def _egpo_step(config: RunConfig) -> None:
    """EGPO advantages for one group under the run's settings (the trainer forces EGPO even
    where lam = 0 would pick GRPO)."""
    responses = torch.tensor([[S, 5, E, 7], [S, 5, E, 7], [S, 6, E, 8]])
    mask = torch.ones(3, 4)
    rewards = torch.zeros(3, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5])
    settings = AdvantageSettings(lam=config.egpo.lam, alpha=config.egpo.alpha,
                                 variant=config.egpo.variant, cot_start_id=S, cot_end_id=E)
    advantages = ADVANTAGE_ESTIMATORS.get("egpo")(
        rewards, mask, ["g"] * 3, entropies=torch.full((3, 4), 2.5), responses=responses,
        settings=settings)
    assert bool(torch.isfinite(advantages).all())


GRID = [(lam, alpha, variant) for lam in (0.0, 0.4, 1.0, 1.5, 3.0)
        for alpha in (0.5, 1.0, 1.0001, 2.0) for variant in ("clip", "paper")]


@pytest.mark.parametrize(("lam", "alpha", "variant"), GRID)
def test_egpo_accepted_exactly_where_the_trainer_runs(lam: float, alpha: float,
                                                      variant: str) -> None:
    egpo = {"lam": lam, "alpha": alpha, "variant": variant}
    try:
        config = RunConfig.model_validate({"egpo": egpo})
    except ValidationError as refused:
        locs = [e["loc"] for e in refused.errors()]
        assert locs in ([("egpo", "lam")], [("egpo", "alpha")])
        with pytest.raises(ValueError, match="flip"):
            _egpo_step(RunConfig.model_construct(egpo=RunConfig().egpo.model_construct(**egpo)))
        return
    _egpo_step(config)


def _random_correction(rng: random.Random) -> dict[str, Any]:
    """Settings drawn from in- and out-of-range values and every combination of fields."""
    pick = rng.choice
    out: dict[str, Any] = {}
    for name, values in (("mode", ["decoupled", "bypass"]),
                         ("loss_type", ["ppo_clip", "reinforce"]),
                         ("is_level", ["none", "token", "sequence"]),
                         ("is_threshold", [0.5, 1.0, 2.0, 1e7]),
                         ("is_threshold_lower", [None, 0.0, 0.5, 1.0, 1.5]),
                         ("is_batch_normalize", [False, True])):
        if rng.random() < 0.7:
            out[name] = pick(values)
    rules = []
    for mode in rng.sample(list(REJECTION_MODES), rng.randint(0, 3)):
        rule: dict[str, Any] = {"mode": mode, "upper": pick([0.0, 0.01, 0.9, 1.0, 3.0])}
        if rng.random() < 0.3:
            rule["lower"] = pick([0.5, 1.0, 2.0])
        rules.append(rule)
    if rules and rng.random() < 0.2:
        rules.append(dict(rules[0]))
    out["rejection"] = rules
    return out


def test_every_accepted_correction_trains_and_every_refusal_names_a_field() -> None:
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    mask = (torch.rand((4, 6), generator=generator) > 0.2).float()
    rollout = (-torch.rand((4, 6), generator=generator) * 3 - 0.01) * mask
    old = (rollout + torch.randn((4, 6), generator=generator) * 0.5) * mask
    new = (old + torch.randn((4, 6), generator=generator) * 0.1).requires_grad_(True)
    advantages = torch.randn((4, 6), generator=generator)
    accepted = refused = 0
    for _ in range(400):
        spec = _random_correction(rng)
        try:
            config = RunConfig.model_validate({"correction": spec}).correction
        except ValidationError as error:
            refused += 1
            loc = error.errors()[0]["loc"]
            assert loc[0] == "correction" and len(loc) >= 2, loc
            continue
        accepted += 1
        result = compute_correction(old, rollout, mask, config)
        assert bool(torch.isfinite(result.weights).all())
        assert all(math.isfinite(v) for v in result.metrics.values())
        if config.mode == "bypass":
            loss, _ = bypass_policy_loss(rollout, new, advantages, mask, config)
            loss.backward()
            assert math.isfinite(float(loss.detach()))
    assert accepted > 40 and refused > 40


@pytest.mark.parametrize("temperature", [0.0, 0.7, 2.0])
@pytest.mark.parametrize("negative_reward", [-1.0, 0.0, -1e9])
def test_accepted_rollout_temperature_and_negative_reward_train(temperature: float,
                                                                negative_reward: float) -> None:
    config = RunConfig.model_validate({"rollout": {"temperature": temperature},
                                       "negatives": {"negative_reward": negative_reward}})
    temps, _ = scoring_temperatures(["e"], {}, config)
    ids = np.arange(6, dtype=np.int32)
    sample = StoredSample(sample_id=1, run_id="r", group_id="g", episode_id="e", agent="main",
                          kind="negative", reward=config.negatives.negative_reward,
                          policy_version=0, prompt_length=2, token_ids=ids,
                          loss_mask=(ids >= 2).astype(np.uint8),
                          logprobs=np.zeros(6, dtype=np.float32))
    batch = pad_samples([sample], pad_token_id=0, temperatures=temps)
    assert float(batch.temperatures[0]) == (temperature or 1.0)


@pytest.mark.parametrize(("config", "loc"), [
    ({"rollout": {"temperature": math.inf}}, ("rollout", "temperature")),
    ({"negatives": {"negative_reward": math.nan}}, ("negatives", "negative_reward")),
    ({"egpo": {"alpha": math.inf}}, ("egpo", "alpha")),
    ({"chat_template": "{% for m in messages %}{{ m.content }}"}, ("chat_template",)),
])
def test_values_that_fail_later_are_refused_now(config: dict[str, Any],
                                                loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(config)
    assert [e["loc"] for e in info.value.errors()] == [loc]


def test_templates_transformers_compiles_are_accepted() -> None:
    """The syntax check accepts what transformers' chat templates use: loop controls and the
    ``{% generation %}`` block."""
    from workers.engines.chat_template import CHAT_TEMPLATE

    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
                "{% if loop.index > 9 %}{% break %}{% endif %}{% endfor %}")
    for text in (CHAT_TEMPLATE, template):
        assert RunConfig(chat_template=text).chat_template == text


def test_a_run_stored_before_a_check_still_reads(trainer_store: Any) -> None:
    """The checks that span several fields apply when a run is created; a run the log holds
    from before them (here an EGPO 'paper' run with alpha 0.5 and a template that does not
    parse) still reads back."""
    run_id = f"old-{uuid.uuid4().hex[:8]}"
    old = RunConfig.model_construct(**{
        **dict(RunConfig()), "chat_template": "{{ messages ",
        "egpo": EgpoConfig.model_construct(lam=0.4, alpha=0.5, variant="paper")})
    trainer_store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=old)],
                         NO_STREAM)
    read = trainer_store.get_run(run_id).config
    assert (read.egpo.variant, read.egpo.alpha, read.chat_template) == ("paper", 0.5,
                                                                        "{{ messages ")
    with pytest.raises(ValidationError):
        RunConfig.model_validate(read.model_dump())
