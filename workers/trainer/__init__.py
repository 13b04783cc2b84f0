"""Training: GRPO/EGPO advantages, the PPO policy loss, and chunked log-probs and entropies.

The pure-math modules need only torch (not numpy, no database, no transformers) and can be
imported on their own by other trainers, verl included:

- :mod:`workers.trainer.egpo`: ``grpo_advantages``, ``egpo_advantages``, ``cot_mask``
- :mod:`workers.trainer.losses`: ``ppo_policy_loss``, ``agg_loss``, ``kl_penalty`` and the
  entropy and KL loss terms
- :mod:`workers.trainer.logits`: per-token log-probs and entropies without materialising the
  full logits

The trainer worker (needs the store, numpy and transformers):

- :mod:`workers.trainer.loop`: ``Trainer`` and its step (lease, pad, recompute, advantages,
  PPO epochs, checkpoint, ``policy_updated``, weight push, acknowledgement)
- :mod:`workers.trainer.config`: ``TrainerConfig``, every hyperparameter with its default
- :mod:`workers.trainer.batch`, :mod:`workers.trainer.policy`, :mod:`workers.trainer.ppo`,
  :mod:`workers.trainer.advantages`, :mod:`workers.trainer.checkpoint`,
  :mod:`workers.trainer.weights`: its parts
- :mod:`workers.trainer.worker`: the per-run trainer cache behind the ``train_step`` task;
  :mod:`trajstore.train_cli`: ``trajstore train``

This package module imports none of them, so importing one never pulls in the others' needs.
"""

__all__: list[str] = []
