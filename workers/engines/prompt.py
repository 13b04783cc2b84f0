"""Rendering chat requests to prompt token ids and decoding responses, for local backends.

Backends that own a tokenizer (transformers, vLLM offline, replay) render ``messages`` with the
tokenizer's chat template themselves and hand token ids to the engine, so the ``prompt_ids``
they report are exactly the ids the engine consumed.

A run that names its tokenizer or its own chat template (``RunConfig.tokenizer_name``,
``RunConfig.chat_template``) is rendered by the agent loop instead, with :class:`RunPrompt`:
the tokenizer and template replay segments the run's prompts with, so the prompt ids the
engine is given are the rendering replay expects, whatever the engine's own template.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from store.events import RunConfig
from workers.engines.backend import GenerationRequest
from workers.engines.render import prompt_ids

__all__ = ["RunPrompt", "decode_response", "end_of_turn_ids", "render_prompt_ids",
           "run_prompt"]


class RunPrompt:
    """A run's prompt rendering: ``tokenizer`` with ``chat_template`` (the tokenizer's own
    when None), as replay renders the run's prompts (module docstring). Raises ValueError
    when there is no template at all, TypeError for a template that is not a string."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string, got "
                            f"{type(chat_template).__name__}")
        if not chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the run's tokenizer has no chat_template and the run sets none")
        self.tokenizer = tokenizer
        self.chat_template = chat_template or None

    def ids(self, messages: Sequence[Mapping[str, Any]],
            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The prompt ids of ``messages`` and ``tools`` with the generation prompt appended
        (:func:`workers.engines.render.prompt_ids`); the template's own errors propagate."""
        return prompt_ids(self.tokenizer, messages, tools=tools,
                          chat_template=self.chat_template)


def run_prompt(config: RunConfig, *, backend: Any = None) -> RunPrompt | None:
    """The rendering rollout uses for a run with ``config``: the run's tokenizer
    (``tokenizer_name``, loaded with :func:`workers.engines.tokenizers.load_tokenizer`) with its
    ``chat_template``; a template without a tokenizer name is used with ``backend``'s
    ``tokenizer``. None when the run names neither (the backend renders with its own).
    Raises ``TokenizerNotFound`` for a tokenizer that cannot be loaded here, ValueError for
    a template with neither a tokenizer name nor a backend tokenizer."""
    name = config.tokenizer_name
    if name is None and config.chat_template is None:
        return None
    if name is not None:
        from workers.engines.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(name)
    else:
        tokenizer = getattr(backend, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("the run sets a chat_template but names no tokenizer "
                             "(RunConfig.tokenizer or .model) and the backend has none")
    return RunPrompt(tokenizer, chat_template=config.chat_template)

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")


def render_prompt_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt ids of ``request``: its ``prompt_ids`` as given, or its messages (and tools)
    rendered with ``tokenizer``'s chat template and the generation prompt appended
    (:func:`workers.engines.render.prompt_ids`, the renderer replay's text matches).
    Raises ValueError when the tokenizer has no chat template, or when an id is outside the
    tokenizer's vocabulary."""
    if request.prompt_ids is not None:
        ids = list(request.prompt_ids)
        bad = [i for i in ids if i >= len(tokenizer)]
        if bad:
            raise ValueError(f"prompt_ids contains id {bad[0]} outside the vocabulary of size "
                             f"{len(tokenizer)}")
        return ids
    key = (id(tokenizer), id(request.messages), id(request.tools))
    with _rendered_lock:
        hit = _rendered.get(key)
    # The entry holds the very objects it was made from, so their ids cannot be reused
    # while it lives: identity means the same (immutable) request content.
    if (hit is not None and hit[0] is tokenizer and hit[1] is request.messages
            and hit[2] is request.tools):
        return list(hit[3])
    ids = prompt_ids(tokenizer, request.messages or (), tools=request.tools)
    with _rendered_lock:
        _rendered[key] = (tokenizer, request.messages, request.tools, tuple(ids))
        while len(_rendered) > _RENDERED_KEPT:
            _rendered.popitem(last=False)
    return ids


#: The agent loop renders a request to budget its tokens and the engine renders it again to
#: generate: the last renderings are kept, keyed by the identity of the request's messages.
_RENDERED_KEPT = 1024
_rendered: OrderedDict[tuple[int, int, int], tuple[Any, Any, Any, tuple[int, ...]]] = (
    OrderedDict())
_rendered_lock = threading.Lock()


def end_of_turn_ids(tokenizer: Any, extra: Sequence[int] | int | None = None) -> list[int]:
    """Token ids that end a generation: ``<|im_end|>``, ``<|endoftext|>`` (those present),
    the tokenizer's eos and any ``extra`` ids (e.g. a generation config's eos list)."""
    ids: list[int] = []
    unknown = getattr(tokenizer, "unk_token_id", None)
    for token in _END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != unknown:
            ids.append(token_id)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if isinstance(extra, int):
        ids.append(extra)
    elif extra is not None:
        ids.extend(int(i) for i in extra)
    return sorted(set(ids))


def decode_response(tokenizer: Any, response_ids: Sequence[int], *,
                    stop: Sequence[str] = ()) -> tuple[str, bool]:
    """Decode generated ids, dropping control tokens and keeping markup tokens; cut the text
    before the earliest stop string. Returns ``(text, stopped_on_string)``."""
    text = tokenizer.decode(list(response_ids), skip_special_tokens=True)
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    if cut >= 0:
        return text[:cut], True
    return text, False
