"""Engines: the one room for talking to a model.

This package imports none of its modules, so a light one (the prompt renderer, the types)
never loads torch or vLLM:

- the seam: :mod:`workers.engines.backend` (``GenerationRequest``, ``GenerationResult``,
  ``SamplingParams``, the ``GenerationBackend`` and ``WeightUpdatable`` protocols);
- the backends: :mod:`~workers.engines.backend_transformers`,
  :mod:`~workers.engines.backend_vllm`, :mod:`~workers.engines.backend_openai` (an
  OpenAI-compatible server), :mod:`~workers.engines.backend_remote` (a remote trainer's
  completions endpoint), :mod:`~workers.engines.backend_replay` (recorded responses, real
  logprobs); those a worker builds by name are in :mod:`~workers.engines.registry`;
- engine ids for ``policy_served`` reports: :mod:`~workers.engines.identity`;
- batching and log-probabilities: :mod:`~workers.engines.batching`,
  :mod:`~workers.engines.logprobs`;
- prompts: :mod:`~workers.engines.render` (the one prompt renderer: chat messages to prompt
  ids and to text, which replay segments), :mod:`~workers.engines.prompt` (a request's prompt
  ids, a run's rendering, decoding), :mod:`~workers.engines.chat_template` (the tiny model's
  ChatML template), :mod:`~workers.engines.toolcall` (parsing a generated turn);
- tokenizers: :mod:`~workers.engines.tokenizers` (the one rule for a run's tokenizer name) and
  the tiny model built locally: :mod:`~workers.engines.tinymodel`.

It imports nothing from rollout, replay or the trainer, which all stand above it.
"""
