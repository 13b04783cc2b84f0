"""The in-process engine: a ``workers.rollout`` transformers backend inside the API process.

It serves the gateway when no upstream server is configured, and makes the API itself an
OpenAI-compatible server with vLLM's token-id extensions, so one API process can be another
one's upstream. One generation runs at a time (the backend is not thread-safe); callers run
``generate`` in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.settings import Settings
from workers.engines.backend import GenerationRequest, GenerationResult

__all__ = ["LocalEngine", "engine_model_dir"]


def engine_model_dir(settings: Settings) -> Path | None:
    """The model folder ``gateway_engine_model`` names (``"tiny"``: the built-in tiny model,
    built once under the data directory), or None when it names none. Raises ValueError
    for a folder that does not exist."""
    name = settings.gateway_engine_model
    if not name:
        return None
    if name == "tiny":
        from workers.engines.tinymodel import tiny_model_path

        return tiny_model_path(settings.data_dir / "models")
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(f"gateway_engine_model {name!r} is not a model folder")
    return path


class LocalEngine:
    """A transformers model answering generation requests one at a time."""

    def __init__(self, model_dir: Path, *, device: str = "cpu", name: str = "trajstore"
                 ) -> None:
        from workers.engines.backend_transformers import TransformersBackend

        self.backend = TransformersBackend(model_dir, device=device)
        self.tokenizer: Any = self.backend.tokenizer
        self.name = name
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._same_vocabulary: dict[int, bool] = {}
        rows = int(self.backend.model.get_input_embeddings().num_embeddings)
        if len(self.tokenizer) > rows:
            raise ValueError(f"the engine's tokenizer in {model_dir} has {len(self.tokenizer)} "
                             f"tokens but its model only {rows} embeddings: they do not belong "
                             "together")

    def vocabulary_matches(self, tokenizer: Any) -> bool:
        """Whether ``tokenizer`` maps every token to the id the engine's own tokenizer does
        (and knows no other): then ids rendered with it are ids this engine reads."""
        if tokenizer is self.tokenizer:
            return True
        key = id(tokenizer)
        with self._lock:
            known = self._same_vocabulary.get(key)
        if known is None:
            known = bool(tokenizer.get_vocab() == self.tokenizer.get_vocab())
            with self._lock:
                self._same_vocabulary[key] = known
        return known

    @property
    def vocabulary_size(self) -> int:
        return len(self.tokenizer)

    def generate(self, request: GenerationRequest,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Generate one response (blocks while another generation runs). Raises ValueError
        for a prompt that does not fit the model's context or ids outside its vocabulary.
        ``on_token`` gets each generated id as it is sampled (token streaming)."""
        with self._lock:
            return self.backend.generate(request, on_token)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt ids ``generate`` will feed the model for ``request``."""
        return list(self.backend.prompt_ids(request))

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        """The text of one token (for OpenAI logprob entries)."""
        return str(self.tokenizer.decode([int(token_id)]))

    def close(self) -> None:
        self.backend = None  # type: ignore[assignment]
