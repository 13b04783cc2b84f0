"""Rollout: the agent loop with tool-call rollback, its groups, tools, tasks and rewards.

Import what you need from its modules; this package imports none of them, so reading one
light module (a remote rollout's request checks, say) loads no agent loop:

- the agent loop: :mod:`workers.rollout.loop` (``run_episode``), with its rollback policy
  (:mod:`~workers.rollout.rollback`), event sinks (:mod:`~workers.rollout.sink`,
  :mod:`~workers.rollout.episode_writer`) and asyncio bridges (:mod:`~workers.rollout.aio`);
- tools: :mod:`~workers.rollout.tools` (the seam and registry), :mod:`~workers.rollout.calculator`,
  :mod:`~workers.rollout.sandbox`, :mod:`~workers.rollout.builtin_tools`,
  :mod:`~workers.rollout.tool_runner`;
- tasks and rewards: :mod:`~workers.rollout.agent_tasks`, :mod:`~workers.rollout.chat_messages`,
  :mod:`~workers.rollout.rewards`; the tiny model's warm start: :mod:`~workers.rollout.warmstart`;
- groups of the rollout queue: :mod:`~workers.rollout.group`, :mod:`~workers.rollout.group_log`,
  the worker's side :mod:`~workers.rollout.worker`, :mod:`~workers.rollout.runtime`,
  :mod:`~workers.rollout.worker_engine` (its engine, kept between tasks), Celery tasks in
  :mod:`~workers.rollout.celery_tasks`;
- remote rollouts: :mod:`~workers.rollout.remote` (played on rollout workers), their request
  checks :mod:`~workers.rollout.remote_request` and their queueing
  :mod:`~workers.rollout.remote_dispatch` (both of which the API imports); a user's
  RolloutServer as a run's agent: :mod:`~workers.rollout.remote_agent`, the credentials it
  is given minted by :mod:`~workers.rollout.credentials` (the database, or the API).

Talking to a model (request and result types, the backends, prompts, tokenizers, tool-call
parsing) is :mod:`workers.engines`, a room below this one.
"""
