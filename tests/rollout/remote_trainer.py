"""A trainer's completions endpoint for remote-rollout tests: a real HTTP server (FastAPI under
uvicorn, in a thread) that generates with the tiny model and checks the ``response_mask``.

Per rollout it keeps the token buffer a trainer keeps (each prompt, each generation) and
records for every call the mask received, the number of zeros the buffer says it should hold
(``len(prompt) - len(previous prompt + generation)``), whether the prompt extends that buffer,
and the ``Authorization`` header. Behaviour per rollout id:

- ``script(rollout_id, texts)``: answers are forced through the real model
  (:class:`ReplayBackend`: real token ids and logprobs), so tool calls happen on cue;
- ``fail(rollout_id, kind, on_call)``: from call ``on_call`` (1-based) on, answer with an HTTP
  status (``kind`` an int), ``"not_json"``, ``"missing_token_ids"``, ``"short_logprobs"``
  or ``"slow"`` (answer after 3 s, past a short client timeout);
- ``vllm_form(rollout_id)``: ids and logprobs in vLLM's ``choices[0]`` form;
- otherwise: sampled by the transformers backend.

With ``api_key`` set, calls without ``Authorization: Bearer <api_key>`` get 401.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tests.servers import ThreadedServer
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.prompt import render_prompt_ids
from workers.engines.toolcall import parse_response

__all__ = ["CallRecord", "TrainerServer"]


@dataclass
class CallRecord:
    rollout_id: str
    response_mask: list[int] | None
    expected_zeros: int | None
    extends_buffer: bool | None
    prompt_ids: list[int]
    new_prompt_ids: list[int]
    authorization: str | None
    body: dict[str, Any]


@dataclass
class _Rollout:
    buffer: list[int] = field(default_factory=list)
    calls: int = 0


class TrainerServer:
    """The endpoint described in the module docstring, on ``url`` while running."""

    def __init__(self, backend: TransformersBackend, *, api_key: str | None = None) -> None:
        self.backend = backend
        self.api_key = api_key
        self.records: list[CallRecord] = []
        self.rollouts: dict[str, _Rollout] = {}
        self.scripts: dict[str, ReplayBackend] = {}
        self.failures: dict[str, tuple[Any, int]] = {}
        self.vllm_forms: set[str] = set()
        self.lock = threading.Lock()
        self.app = self._make_app()
        self.server = ThreadedServer(self.app, lifespan="off")
        self.port, self.url = self.server.port, self.server.url

    def script(self, rollout_id: str, texts: list[str]) -> None:
        self.scripts[rollout_id] = ReplayBackend(self.backend, texts)

    def fail(self, rollout_id: str, kind: Any, *, on_call: int = 1) -> None:
        self.failures[rollout_id] = (kind, on_call)

    def vllm_form(self, rollout_id: str) -> None:
        self.vllm_forms.add(rollout_id)

    def calls(self, rollout_id: str) -> list[CallRecord]:
        return [r for r in self.records if r.rollout_id == rollout_id]

    def __enter__(self) -> TrainerServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        async def completions(request: Request) -> Response:
            body = await request.json()
            # Generation is blocking work; keep it off the event loop like a real server.
            import anyio

            return await anyio.to_thread.run_sync(
                self._answer, body, request.headers.get("authorization"))

        app.post("/v1/completions")(completions)
        app.post("/v1/chat/completions")(completions)
        return app

    def _answer(self, body: dict[str, Any], authorization: str | None) -> Response:
        if self.api_key is not None and authorization != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"code": "unauthorized",
                                           "message": "bad key"}}, status_code=401)
        rollout_id = body["rollout_id"]
        with self.lock:
            state = self.rollouts.setdefault(rollout_id, _Rollout())
            state.calls += 1
            call_number = state.calls
        failure = self.failures.get(rollout_id)
        if failure is not None and call_number >= failure[1]:
            kind = failure[0]
            if isinstance(kind, int):
                return JSONResponse({"error": {"code": "failure", "message": f"HTTP {kind}"}},
                                    status_code=kind)
            if kind == "not_json":
                return PlainTextResponse("<html>upstream exploded</html>")
            if kind == "slow":
                time.sleep(3.0)
        request = GenerationRequest(
            sampling=SamplingParams(temperature=body["temperature"], top_p=body["top_p"],
                                    max_tokens=body["max_tokens"], seed=body.get("seed"),
                                    stop=tuple(body.get("stop") or ())),
            messages=tuple(body["messages"]), tools=tuple(body.get("tools") or ()) or None)
        prompt = render_prompt_ids(self.backend.tokenizer, request)
        mask = body.get("response_mask")
        if state.buffer:
            expected: int | None = len(prompt) - len(state.buffer)
            extends: bool | None = prompt[: len(state.buffer)] == state.buffer
            new = prompt[len(state.buffer):]
        else:
            expected, extends, new = None, None, prompt
        self.records.append(CallRecord(rollout_id, mask, expected, extends, prompt, new,
                                       authorization, body))
        engine = self.scripts.get(rollout_id, self.backend)
        result = engine.generate(request)
        token_ids = result.response_ids.tolist()
        state.buffer = prompt + token_ids
        logprobs = result.logprobs.tolist()
        if failure is not None and call_number >= failure[1]:
            if failure[0] == "missing_token_ids":
                return JSONResponse({"choices": [{"message": {"content": result.text}}]})
            if failure[0] == "short_logprobs":
                logprobs = logprobs[:-1]
        message = parse_response(result.text, call_id=f"srv_{call_number}").to_message()
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "finish_reason": result.finish_reason}
        answer: dict[str, Any] = {"id": f"cmpl-{rollout_id}-{call_number}",
                                  "created": int(time.time()), "model": "tiny",
                                  "choices": [choice],
                                  "usage": {"prompt_tokens": len(prompt),
                                            "completion_tokens": len(token_ids)}}
        if rollout_id in self.vllm_forms:
            choice["token_ids"] = token_ids
            choice["prompt_token_ids"] = result.prompt_ids.tolist()
            choice["logprobs"] = {"content": [{"token": str(t), "logprob": lp}
                                              for t, lp in zip(token_ids, logprobs,
                                                               strict=False)]}
        else:
            answer.update(token_ids=token_ids, logprobs=logprobs,
                          prompt_token_ids=result.prompt_ids.tolist())
        return JSONResponse(answer)
