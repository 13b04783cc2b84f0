"""OpenAI response bodies and stream chunks, written for the in-process engine and read back
from an upstream server (non-streamed or streamed) to capture the call.

The in-process engine answers like vLLM's OpenAI server: ``reasoning_content`` split off a
leading ``<think>`` block, ``tool_calls`` parsed when the request offered tools, and with
``return_token_ids`` the vLLM extensions ``prompt_token_ids`` (top level for chat, in the
choice for completions) and ``choices[0].token_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.engines.toolcall import parse_response

__all__ = [
    "Captured",
    "IncompleteAnswer",
    "StreamAccumulator",
    "assistant_message",
    "captured_chat",
    "captured_completion",
    "chat_chunks",
    "chat_response",
    "chat_tail_chunks",
    "completion_chunks",
    "completion_response",
    "strip_extensions",
]

TokenText = Callable[[int], str]


@dataclass
class Captured:
    """What the gateway records of one generation."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    message: dict[str, Any]
    finish_reason: str | None
    usage: dict[str, Any] | None = None


def _after_reasoning(text: str) -> str:
    end = text.find("</think>")
    if end >= 0:
        return text[end + len("</think>"):]
    return "" if text.lstrip().startswith("<think>") else text


def assistant_message(text: str, *, call_id: str, parse_tools: bool) -> dict[str, Any]:
    """The assistant message of generated ``text``: ``reasoning_content`` when it opens with
    a ``<think>`` block, and, with ``parse_tools``, well-formed ``tool_calls`` (ids
    ``<call_id>-<n>``). A turn with a malformed tool call keeps its raw text as content and
    gets no tool calls, so that sending the message back renders the same tokens."""
    parsed = parse_response(text, call_id=call_id)
    message: dict[str, Any] = {"role": "assistant"}
    rest = _after_reasoning(text) if parsed.reasoning_content is not None else text
    if parse_tools and parsed.tool_calls and parsed.well_formed:
        message["content"] = parsed.content or None
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    else:
        message["content"] = rest.strip()
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    return message


def _finish(finish_reason: str, message: dict[str, Any]) -> str:
    return "tool_calls" if message.get("tool_calls") and finish_reason == "stop" \
        else finish_reason


def _chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], token_text: TokenText
                   ) -> dict[str, Any]:
    content = []
    for token_id, lp in zip(ids, logprobs, strict=True):
        text = token_text(token_id)
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()),
                        "top_logprobs": []})
    return {"content": content}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_response(*, request_id: str, created: int, model: str, message: dict[str, Any],
                  finish_reason: str, prompt_ids: Sequence[int], response_ids: Sequence[int],
                  logprobs: Sequence[float], token_text: TokenText | None,
                  return_token_ids: bool) -> dict[str, Any]:
    """A ``chat.completion`` body; ``token_text`` given means the caller asked for
    logprobs."""
    choice: dict[str, Any] = {
        "index": 0, "message": message,
        "logprobs": (_chat_logprobs(response_ids, logprobs, token_text)
                     if token_text is not None else None),
        "finish_reason": _finish(finish_reason, message), "stop_reason": None,
    }
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion", "created": created,
                            "model": model, "choices": [choice],
                            "usage": _usage(len(prompt_ids), len(response_ids))}
    if return_token_ids:
        choice["token_ids"] = [int(i) for i in response_ids]
        body["prompt_token_ids"] = [int(i) for i in prompt_ids]
    return body


@dataclass(frozen=True)
class _ChatStream:
    """The ``chat.completion.chunk`` bodies of one streamed answer: every chunk carries the
    same id, time and model; token ids and logprobs ride on the chunk that ends a part."""

    request_id: str
    created: int
    model: str
    token_text: TokenText
    want_logprobs: bool
    return_token_ids: bool

    def chunk(self, delta: dict[str, Any], *, finish: str | None = None,
              ids: Sequence[int] = (), lps: Sequence[float] = ()) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
        if self.want_logprobs and ids:
            choice["logprobs"] = _chat_logprobs(ids, lps, self.token_text)
        if self.return_token_ids:
            choice["token_ids"] = [int(i) for i in ids]
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model, "choices": [choice]}

    def parts(self, message: dict[str, Any], content: str, response_ids: Sequence[int],
              logprobs: Sequence[float]) -> list[dict[str, Any]]:
        """One chunk per part of ``message`` (reasoning, ``content``, tool calls; an empty
        content when it has none), the ids and logprobs of the whole answer on the last."""
        parts: list[dict[str, Any]] = []
        if message.get("reasoning_content") is not None:
            parts.append({"reasoning_content": message["reasoning_content"]})
        if content:
            parts.append({"content": content})
        if message.get("tool_calls"):
            parts.append({"tool_calls": [dict(c, index=i)
                                         for i, c in enumerate(message["tool_calls"])]})
        if not parts:
            parts.append({"content": ""})
        ids, lps = list(response_ids), list(logprobs)
        last = len(parts) - 1
        return [self.chunk(delta, ids=ids if i == last else (), lps=lps if i == last else ())
                for i, delta in enumerate(parts)]

    def end(self, message: dict[str, Any], finish_reason: str, prompt_ids: Sequence[int],
            response_ids: Sequence[int], include_usage: bool) -> list[dict[str, Any]]:
        """The finish chunk, and the usage chunk when asked for."""
        out = [self.chunk({}, finish=_finish(finish_reason, message))]
        if include_usage:
            out.append({"id": self.request_id, "object": "chat.completion.chunk",
                        "created": self.created, "model": self.model, "choices": [],
                        "usage": _usage(len(prompt_ids), len(response_ids))})
        return out


def chat_chunks(*, request_id: str, created: int, model: str, message: dict[str, Any],
                finish_reason: str, prompt_ids: Sequence[int], response_ids: Sequence[int],
                logprobs: Sequence[float], token_text: TokenText, want_logprobs: bool,
                return_token_ids: bool, include_usage: bool) -> list[dict[str, Any]]:
    """``chat.completion.chunk`` bodies of one finished generation. A plain-text answer is
    sent a token per chunk (each with its token id and logprob); an answer with reasoning or
    tool calls is sent as one chunk per part, token ids and logprobs on the last of them."""
    stream = _ChatStream(request_id, created, model, token_text, want_logprobs,
                         return_token_ids)
    first = stream.chunk({"role": "assistant", "content": ""})
    if return_token_ids:
        first["prompt_token_ids"] = [int(i) for i in prompt_ids]
    content = message.get("content") or ""
    if "reasoning_content" in message or "tool_calls" in message:
        body = stream.parts(message, content, response_ids, logprobs)
    else:
        body = [stream.chunk({"content": token_text(token_id)}, ids=[token_id], lps=[lp])
                for token_id, lp in zip(response_ids, logprobs, strict=True)]
        # Control tokens decode to text the message does not hold; send the message's own
        # text when the pieces do not add up to it.
        if "".join(c["choices"][0]["delta"]["content"] for c in body) != content:
            body = [stream.chunk({"content": content}, ids=list(response_ids),
                                 lps=list(logprobs))]
    return [first, *body, *stream.end(message, finish_reason, prompt_ids, response_ids,
                                      include_usage)]


def chat_tail_chunks(*, request_id: str, created: int, model: str, message: dict[str, Any],
                     finish_reason: str, prompt_ids: Sequence[int],
                     response_ids: Sequence[int], logprobs: Sequence[float],
                     token_text: TokenText, want_logprobs: bool, return_token_ids: bool,
                     include_usage: bool, sent: str) -> list[dict[str, Any]]:
    """The chunks that end a stream whose content began with ``sent`` (sent live, see
    ``api.gateway.streaming``): the reasoning, the rest of the content and the tool calls,
    the token ids and logprobs of the whole answer on the last of them, then the finish
    chunk (and usage). The role chunk was sent first."""
    stream = _ChatStream(request_id, created, model, token_text, want_logprobs,
                         return_token_ids)
    content = message.get("content") or ""
    rest = content[len(sent):] if content.startswith(sent) else ""
    return [*stream.parts(message, rest, response_ids, logprobs),
            *stream.end(message, finish_reason, prompt_ids, response_ids, include_usage)]


def _completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], token_text: TokenText
                         ) -> dict[str, Any]:
    tokens = [token_text(i) for i in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": [{} for _ in tokens], "text_offset": offsets}


def completion_response(*, request_id: str, created: int, model: str, text: str,
                        finish_reason: str, prompt_ids: Sequence[int],
                        response_ids: Sequence[int], logprobs: Sequence[float],
                        token_text: TokenText | None, return_token_ids: bool
                        ) -> dict[str, Any]:
    """A ``text_completion`` body; ``token_text`` given means the caller asked for
    logprobs."""
    choice: dict[str, Any] = {
        "index": 0, "text": text,
        "logprobs": (_completion_logprobs(response_ids, logprobs, token_text)
                     if token_text is not None else None),
        "finish_reason": finish_reason, "stop_reason": None,
    }
    if return_token_ids:
        choice["prompt_token_ids"] = [int(i) for i in prompt_ids]
        choice["token_ids"] = [int(i) for i in response_ids]
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": _usage(len(prompt_ids), len(response_ids))}


def completion_chunks(*, request_id: str, created: int, model: str, text: str,
                      finish_reason: str, prompt_ids: Sequence[int],
                      response_ids: Sequence[int], logprobs: Sequence[float],
                      token_text: TokenText, want_logprobs: bool, return_token_ids: bool,
                      include_usage: bool) -> list[dict[str, Any]]:
    """``text_completion`` stream chunks of one finished generation: the whole text in one
    chunk with every token id and logprob, then the finish chunk."""
    body = completion_response(
        request_id=request_id, created=created, model=model, text=text, finish_reason="",
        prompt_ids=prompt_ids, response_ids=response_ids, logprobs=logprobs,
        token_text=token_text if want_logprobs else None, return_token_ids=return_token_ids)
    body.pop("usage")
    body["choices"][0]["finish_reason"] = None
    end: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": None,
                     "finish_reason": finish_reason, "stop_reason": None}]}
    if return_token_ids:
        end["choices"][0]["token_ids"] = []
    out = [body, end]
    if include_usage:
        out.append({"id": request_id, "object": "text_completion", "created": created,
                    "model": model, "choices": [],
                    "usage": _usage(len(prompt_ids), len(response_ids))})
    return out


class IncompleteAnswer(ValueError):
    """An upstream answer lacks the token ids or logprobs the gateway records."""


def _need(value: Any, what: str) -> Any:
    if value is None:
        raise IncompleteAnswer(f"the upstream answer has no {what}; the gateway asks for "
                               "return_token_ids and logprobs (a vLLM server that supports "
                               "return_token_ids is needed)")
    return value


def captured_chat(body: dict[str, Any]) -> Captured:
    """The captured call of a ``chat.completion`` body that was asked for token ids and
    logprobs. Raises ``IncompleteAnswer`` when they are missing."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise IncompleteAnswer("the upstream answer has no choices") from None
    content = (choice.get("logprobs") or {}).get("content")
    message = dict(choice.get("message") or {})
    if "reasoning" in message and "reasoning_content" not in message:
        message["reasoning_content"] = message.pop("reasoning")
    message = {k: v for k, v in message.items() if v is not None and v != []}
    message.setdefault("role", "assistant")
    return Captured(
        prompt_ids=list(_need(body.get("prompt_token_ids"), "prompt_token_ids")),
        response_ids=list(_need(choice.get("token_ids"), "choices[0].token_ids")),
        logprobs=[float(item["logprob"]) for item in _need(content, "logprobs")],
        message=message, finish_reason=choice.get("finish_reason"), usage=body.get("usage"))


def captured_completion(body: dict[str, Any]) -> Captured:
    """The captured call of a ``text_completion`` body asked for token ids and logprobs.
    Raises ``IncompleteAnswer`` when they are missing."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise IncompleteAnswer("the upstream answer has no choices") from None
    token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    return Captured(
        prompt_ids=list(_need(choice.get("prompt_token_ids") or body.get("prompt_token_ids"),
                              "prompt_token_ids")),
        response_ids=list(_need(choice.get("token_ids"), "choices[0].token_ids")),
        logprobs=[float(x) for x in _need(token_logprobs, "logprobs")],
        message={"role": "assistant", "content": choice.get("text") or ""},
        finish_reason=choice.get("finish_reason"), usage=body.get("usage"))


@dataclass
class StreamAccumulator:
    """Folds stream chunks (chat or completion) into the captured call."""

    chat: bool
    prompt_ids: list[int] | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    missing_logprobs: bool = False

    def feed(self, chunk: dict[str, Any]) -> None:
        """Take one parsed chunk."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None and self.prompt_ids is None:
            self.prompt_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None and self.prompt_ids is None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            ids = choice.get("token_ids") or []
            self.response_ids.extend(int(i) for i in ids)
            lp = choice.get("logprobs")
            if self.chat:
                entries = (lp or {}).get("content") or []
                self.logprobs.extend(float(e["logprob"]) for e in entries)
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self.content.append(delta["content"])
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    self.reasoning.append(reasoning)
                for call in delta.get("tool_calls") or []:
                    slot = self.tool_calls.setdefault(int(call.get("index", 0)), {
                        "id": None, "type": "function",
                        "function": {"name": "", "arguments": ""}})
                    if call.get("id"):
                        slot["id"] = call["id"]
                    fn = call.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
            else:
                self.logprobs.extend(float(x) for x in (lp or {}).get("token_logprobs") or [])
                if choice.get("text"):
                    self.content.append(choice["text"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def result(self) -> Captured:
        """The captured call. Raises ``IncompleteAnswer`` when the stream carried no prompt
        ids or fewer logprobs than token ids."""
        if self.prompt_ids is None:
            raise IncompleteAnswer("the upstream stream carried no prompt_token_ids")
        if len(self.logprobs) != len(self.response_ids):
            raise IncompleteAnswer(f"the upstream stream carried {len(self.response_ids)} "
                                   f"token ids but {len(self.logprobs)} logprobs")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return Captured(prompt_ids=self.prompt_ids, response_ids=self.response_ids,
                        logprobs=self.logprobs, message=message,
                        finish_reason=self.finish_reason, usage=self.usage)


def strip_extensions(body: dict[str, Any], *, keep_logprobs: bool, keep_token_ids: bool
                     ) -> dict[str, Any]:
    """``body`` (a response or a chunk) without what the gateway added to the caller's
    request: logprobs the caller did not ask for, and vLLM's token id fields."""
    if not keep_token_ids:
        body.pop("prompt_token_ids", None)
    for choice in body.get("choices") or []:
        if not keep_logprobs:
            choice["logprobs"] = None
        if not keep_token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    return body
