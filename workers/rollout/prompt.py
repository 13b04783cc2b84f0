"""Rendering chat requests to prompt token ids and decoding responses, for local backends.

Backends that own a tokenizer (transformers, vLLM offline, replay) render ``messages`` with the
tokenizer's chat template themselves and hand token ids to the engine, so the ``prompt_ids``
they report are exactly the ids the engine consumed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from workers.replay.render import prompt_ids
from workers.rollout.backend import GenerationRequest

__all__ = ["decode_response", "end_of_turn_ids", "render_prompt_ids"]

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")


def render_prompt_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt ids of ``request``: its ``prompt_ids`` as given, or its messages (and tools)
    rendered with ``tokenizer``'s chat template and the generation prompt appended
    (:func:`workers.replay.render.prompt_ids`, the renderer replay's text matches).
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
