"""The capture gateway: OpenAI-compatible completions that record every call as an
``llm_called`` event with the engine's exact token ids and logprobs, and the remote-rollout
(TrainGate) endpoints with their per-rollout token buffer and response-mask check.

Modules: ``engine`` (the in-process engine), ``upstream`` (an OpenAI-compatible vLLM server),
``openai_format`` (building and reading OpenAI responses and stream chunks), ``messages``
(request normalisation), ``capture`` (the episode a call belongs to, recording it),
``rollout_buffer`` (the remote-rollout token buffer and mask check), ``service`` (the
gateway the routes call).
"""

__all__: list[str] = []
