"""A user's RolloutServer of the remote-rollout protocol, written from its wire contract and
apart from trajstore's own RolloutServer side: a real HTTP server (FastAPI under uvicorn, in
a thread) that plays rollouts against the trainer it is given (``server_url``), which in the
tests is trajstore.

Revisions (``revision``):

- ``sync-completions``: ``POST /rollout`` answered with the RolloutResponse when the rollout
  ends; its generations go to ``{server_url}/v1/completions``;
- ``sync-chat``: the same, to ``{server_url}/v1/chat/completions``;
- ``async``: ``POST /v1/rollout/init`` answered 202 at once with the tools; the rollout plays
  in a thread and its RolloutResponse is posted to ``{server_url}/v1/rollout/completed``.

A rollout: the request's ``messages``, then ``turns`` generations; after each but the last
the user says ``Go on.``. Every generation carries ``Authorization: Bearer`` with the key the
caller gave (``callback_api_key``, ``api_key`` in the asynchronous revision), the
``rollout_id``, the messages, the tools and ``response_mask`` as the protocol's
RolloutSession computes it with a real tokenizer (``tokenizer``, the tiny model's): ``null``
on the first call, then ``[0] * (len(render(messages)) - (previous prompt length + tokens
generated then))``. It keeps, per rollout, the trainer's buffer as the protocol says (the
first prompt's ids, then each answer's ``token_ids``, then the zeros' tokens): ``expected``
holds ``(token_ids, zeros)`` per call, from which the sample's response mask follows token by
token. The reward it reports is ``reward`` (None: none reported).

Misbehaviours (``mode``): ``ok``; ``slow`` (waits ``delay_s`` before playing); ``bad_status``
(answers ``status: "DONE"``); ``not_json`` (answers text); ``other_episode`` (first calls the
trainer for another rollout id with the key it was given, keeping that answer's status in
``stolen``); ``fail`` (answers 500).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tests.servers import ThreadedServer

__all__ = ["AgentServer"]


@dataclass
class AgentServer:
    revision: str
    tokenizer_dir: Path
    turns: int = 2
    mode: str = "ok"
    delay_s: float = 0.0
    reward: float | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    expected: dict[str, list[tuple[list[int], int]]] = field(default_factory=dict)
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    stolen: list[int] = field(default_factory=list)
    playing: int = 0
    #: The most rollouts played at once so far.
    max_playing: int = 0

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        self._lock = threading.Lock()
        self._server: ThreadedServer | None = None

    # --- the server -----------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI()
        if self.revision == "async":
            @app.post("/v1/rollout/init")
            async def init(request: Request) -> Response:
                body = await request.json()
                self.requests.append(body)
                threading.Thread(target=self._play_and_report, args=(body,),
                                 daemon=True).start()
                return JSONResponse({"rollout_id": body["rollout_id"],
                                     "tools": body.get("tools") or []}, status_code=202)
        else:
            @app.post("/rollout")
            def rollout(body: dict[str, Any]) -> Response:
                self.requests.append(body)
                if self.mode == "fail":
                    return PlainTextResponse("boom", status_code=500)
                answer = self.play(body, key=body.get("callback_api_key"),
                                   sampling=body.get("sampling_params") or {})
                if self.mode == "not_json":
                    return PlainTextResponse("done")
                return JSONResponse(answer)
        return app

    def start(self) -> AgentServer:
        self._server = ThreadedServer(self.app()).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    # --- a rollout --------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                 add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _path(self) -> str:
        return "/v1/completions" if self.revision == "sync-completions" \
            else "/v1/chat/completions"

    def play(self, body: dict[str, Any], *, key: str | None, sampling: dict[str, Any]
             ) -> dict[str, Any]:
        """Play one rollout against ``body['server_url']``; the RolloutResponse."""
        with self._lock:
            self.playing += 1
            self.max_playing = max(self.max_playing, self.playing)
        try:
            return self._play(body, key=key, sampling=sampling)
        finally:
            with self._lock:
                self.playing -= 1

    def _play(self, body: dict[str, Any], *, key: str | None, sampling: dict[str, Any]
              ) -> dict[str, Any]:
        rollout_id = str(body["rollout_id"])
        self.keys[rollout_id] = key or ""
        if self.mode == "slow":
            time.sleep(self.delay_s)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        url = str(body["server_url"]).rstrip("/") + self._path()
        tools = body.get("tools")
        messages = [dict(m) for m in body["messages"]]
        if self.mode == "other_episode":
            r = httpx.post(url, headers=headers, timeout=60, json={
                "rollout_id": f"{rollout_id}-not-mine", "messages": messages,
                "max_tokens": 2})
            self.stolen.append(r.status_code)
        expected: list[tuple[list[int], int]] = []
        answers: list[dict[str, Any]] = []
        previous: tuple[int, int] | None = None  # (prompt length, tokens generated)
        finish = "stop"
        for turn in range(self.turns):
            prompt = self.render(messages, tools)
            mask: list[int] | None = None
            if previous is not None:
                zeros = len(prompt) - (previous[0] + previous[1])
                assert zeros >= 0, "the conversation shrank"
                mask = [0] * zeros if zeros else None
                expected[-1] = (expected[-1][0], zeros)
            request: dict[str, Any] = {
                "model": "policy", "rollout_id": rollout_id, "messages": messages,
                "response_mask": mask, "logprobs": True,
                "temperature": sampling.get("temperature", 1.0),
                "top_p": sampling.get("top_p", 1.0),
                "max_tokens": sampling.get("max_tokens", 8)}
            if tools:
                request["tools"] = tools
            if sampling.get("seed") is not None:
                request["seed"] = int(sampling["seed"]) + turn
            r = httpx.post(url, headers=headers, json=request, timeout=120)
            if r.status_code != 200:
                return {"rollout_id": rollout_id, "status": "ERROR", "finish_reason": None,
                        "final_messages": messages, "error_category": "client_error",
                        "error_message": f"the trainer answered {r.status_code}: {r.text}"}
            answer = r.json()
            answers.append(answer)
            choice = answer["choices"][0]
            token_ids = list(answer.get("token_ids") or choice.get("token_ids"))
            prompt_ids = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
            assert len(prompt_ids) == len(prompt), "the trainer rendered another prompt"
            expected.append((token_ids, 0))
            previous = (len(prompt), len(token_ids))
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            messages.append({"role": "assistant", "content": text or ""})
            if choice.get("finish_reason") == "length" and turn == self.turns - 1:
                finish = "max_tokens"
            if turn < self.turns - 1:
                messages.append({"role": "user", "content": "Go on."})
        self.expected[rollout_id] = expected
        self.answers[rollout_id] = answers
        response: dict[str, Any] = {
            "rollout_id": rollout_id, "status": "DONE" if self.mode == "bad_status"
            else "COMPLETED", "finish_reason": finish, "final_messages": messages,
            "error_message": None, "error_category": None,
            "metrics": {"num_llm_calls": len(answers)}}
        if self.reward is not None:
            response["reward"] = self.reward
        return response

    def _play_and_report(self, body: dict[str, Any]) -> None:
        key = body.get("api_key")
        response = self.play(body, key=key, sampling=body.get("completion_params") or {})
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        httpx.post(str(body["server_url"]).rstrip("/") + "/v1/rollout/completed",
                   headers=headers, json=response, timeout=60)
