"""A trainer of the remote-rollout protocol's later revision, written apart from trajstore's
RolloutServer side: a real HTTP server (FastAPI under uvicorn, in a thread) that serves only
the paths it is given (by default ``/v1/chat/completions``) and answers the way that
revision's reference trainer does: ``choices[0].message`` with the content and the tool
calls, and ``token_ids`` that hold only the content's tokens (no tool-call text, no end
token).

Generation is the tiny model forced through scripted texts (``script``), so the ids and
logprobs are the model's. A scripted text is split at its first ``<tool_call>``: the part
before is the content; the blocks after are the tool calls, answered as OpenAI
``tool_calls`` (``form="tool_calls"``, arguments as JSON text) or left as text in
``message.content`` (``form="content"``), with a ``finish_reason`` or without
(``finish_reason=False``). The content's ids are the shortest prefix of the
generated ids that decodes to the content.

Per rollout it keeps the trainer's buffer (each prompt, then the returned ``token_ids``) and
records for every call its path, the mask received, the zeros the buffer says the mask
should hold and whether the prompt extends the buffer. Every request's path is kept in
``paths`` (also those answered 404), and its ``Authorization`` header in ``authorizations``.

As the asynchronous revision's trainer it also takes the completion callback,
``POST /v1/rollout/completed``: each body is kept in ``completed`` (``wait_completed`` waits
for one rollout's); the first ``refuse_completed`` callbacks are answered 503, as a trainer
that is restarting would.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.servers import ThreadedServer
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.prompt import render_prompt_ids

__all__ = ["ChatCall", "ChatTrainer"]

_BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class ChatCall:
    path: str
    rollout_id: str
    response_mask: list[int] | None
    expected_zeros: int | None
    extends_buffer: bool | None
    prompt_ids: list[int]
    new_prompt_ids: list[int]
    token_ids: list[int]
    message: dict[str, Any]


@dataclass
class _Rollout:
    buffer: list[int] = field(default_factory=list)
    engine: ReplayBackend | None = None
    form: str = "tool_calls"
    finish_reason: bool = True


class ChatTrainer:
    """The server of the module docstring, on ``url`` while running."""

    def __init__(self, backend: TransformersBackend, *,
                 paths: tuple[str, ...] = ("/v1/chat/completions",)) -> None:
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.served = paths
        self.calls: list[ChatCall] = []
        self.paths: list[str] = []
        self.rollouts: dict[str, _Rollout] = {}
        self.lock = threading.Lock()
        self.authorizations: list[str | None] = []
        self.completed: list[dict[str, Any]] = []
        self.completed_tries = 0
        self.refuse_completed = 0
        self.arrived = threading.Condition()
        app = FastAPI()

        @app.middleware("http")
        async def remember(request: Request, call_next: Any) -> Response:
            self.paths.append(request.url.path)
            self.authorizations.append(request.headers.get("authorization"))
            response: Response = await call_next(request)
            return response

        async def completions(request: Request) -> Response:
            import anyio

            body = await request.json()
            return await anyio.to_thread.run_sync(self._answer, request.url.path, body)

        for path in paths:
            app.post(path)(completions)

        @app.post("/v1/rollout/completed")
        async def completed(request: Request) -> Response:
            body = await request.json()
            with self.arrived:
                self.completed_tries += 1
                if self.completed_tries <= self.refuse_completed:
                    return JSONResponse({"error": "restarting"}, status_code=503)
                self.completed.append(body)
                self.arrived.notify_all()
            return JSONResponse({"ok": True})
        self.server = ThreadedServer(app, lifespan="off")
        self.port, self.url = self.server.port, self.server.url

    def script(self, rollout_id: str, texts: list[str], *, form: str = "tool_calls",
               finish_reason: bool = True) -> None:
        self.rollouts[rollout_id] = _Rollout(engine=ReplayBackend(self.backend, texts),
                                             form=form, finish_reason=finish_reason)

    def wait_completed(self, rollout_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The first completion callback of ``rollout_id``, waiting up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while True:
                found = [b for b in self.completed if b.get("rollout_id") == rollout_id]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no completion callback for {rollout_id!r}")
                self.arrived.wait(left)

    def calls_of(self, rollout_id: str) -> list[ChatCall]:
        return [c for c in self.calls if c.rollout_id == rollout_id]

    def __enter__(self) -> ChatTrainer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def _content_ids(self, ids: list[int], content: str) -> list[int]:
        """The shortest prefix of ``ids`` that decodes to ``content`` (stripped)."""
        for k in range(len(ids) + 1):
            if self.tokenizer.decode(ids[:k], skip_special_tokens=True).strip() == content:
                return ids[:k]
        raise AssertionError(f"no prefix of the generation decodes to {content!r}")

    def _answer(self, path: str, body: dict[str, Any]) -> Response:
        rollout_id = body["rollout_id"]
        with self.lock:
            state = self.rollouts.setdefault(rollout_id, _Rollout())
        request = GenerationRequest(
            sampling=SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                    max_tokens=body["max_tokens"]),
            messages=tuple(body["messages"]), tools=tuple(body.get("tools") or ()) or None)
        prompt = render_prompt_ids(self.tokenizer, request)
        if state.buffer:
            expected: int | None = len(prompt) - len(state.buffer)
            extends: bool | None = prompt[: len(state.buffer)] == state.buffer
        else:
            expected, extends = None, None
        new = prompt[len(state.buffer):] if extends or not state.buffer else prompt
        if state.engine is None:
            return JSONResponse({"error": "no script for this rollout"}, status_code=400)
        result = state.engine.generate(request)
        ids = result.response_ids.tolist()
        logprobs = result.logprobs.tolist()
        text = result.text
        cut = text.find("<tool_call>")
        content = (text if cut < 0 else text[:cut]).strip()
        content_ids = self._content_ids(ids, content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if cut >= 0 and state.form == "tool_calls":
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": call["name"],
                              "arguments": json.dumps(call["arguments"])}}
                for i, call in enumerate(json.loads(b) for b in _BLOCK.findall(text))]
        elif cut >= 0:
            message["content"] = text.strip()
        state.buffer = prompt + content_ids
        self.calls.append(ChatCall(path, rollout_id, body.get("response_mask"), expected,
                                   extends, prompt, new, content_ids, message))
        choice: dict[str, Any] = {"index": 0, "message": message}
        if state.finish_reason:
            choice["finish_reason"] = "tool_calls" if cut >= 0 else "stop"
        return JSONResponse({
            "id": f"chat-{rollout_id}-{len(self.calls)}", "object": "chat.completion",
            "created": int(time.time()), "model": "tiny", "choices": [choice],
            "token_ids": content_ids, "logprobs": logprobs[: len(content_ids)],
            "prompt_token_ids": prompt})
