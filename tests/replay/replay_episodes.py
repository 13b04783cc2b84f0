"""Episodes for the replay tests, written as event streams the way the rollout worker records
them: prompts rendered with the real tokenizer's chat template and tokenized, generations
tokenized from the assistant turn the template writes for the parsed response.

A ``Script`` plays the part of the agent loop: each ``call`` records an ``llm_called`` with
exact prompt ids; the response's generated ids can be overridden to produce retokenization
drift (same text, different ids) or a cut-off generation.
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

from store.events import (
    AttemptFailed,
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RolledBack,
    ToolReturned,
)

__all__ = ["SEARCH_TOOL", "Script", "tool_call"]

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]},
    },
}


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_1") -> dict[str, Any]:
    """An OpenAI-format tool call with JSON-string arguments."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


class Script:
    """Builds one episode's event stream with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any, *, tools: list[dict[str, Any]] | None = None,
                 group_id: str = "group-1", seed: int = 0, chat_template: str | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        #: The run's own template (None: the tokenizer's).
        self.chat_template = chat_template
        #: What the template's ``strftime_now`` answers (None: transformers' own clock).
        self.clock: Any = None
        self.events: list[Event] = [EpisodeStarted(run_id="run-1", group_id=group_id,
                                                   tools=tools or [])]
        self.rng = random.Random(seed)
        self.calls = 0

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        extra = {"strftime_now": self.clock} if self.clock is not None else {}
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.chat_template, **extra)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generated_text(self, messages: list[dict[str, Any]], response: dict[str, Any]) -> str:
        """What the model wrote for ``response``: the template's assistant turn after the
        generation prompt, up to and including the end-of-turn token."""
        prompt = self.render(messages, generation_prompt=True)
        full = self.render([*messages, response], generation_prompt=False)
        assert full.startswith(prompt), "template does not extend the generation prompt"
        return full[len(prompt):].rstrip()

    def call(self, messages: list[dict[str, Any]], response: dict[str, Any], *,
             agent: str = "main", call_id: str | None = None,
             response_ids: list[int] | None = None, finish_reason: str = "stop",
             tools: list[dict[str, Any]] | None | str = "default") -> LLMCalled:
        """Record one LLM call on ``messages`` answered by ``response``."""
        self.calls += 1
        call_tools = self.tools if tools == "default" else tools
        saved, self.tools = self.tools, call_tools
        try:
            prompt_ids = self.encode(self.render(messages, generation_prompt=True))
            ids = response_ids if response_ids is not None else self.encode(
                self.generated_text(messages, response))
        finally:
            self.tools = saved
        logprobs = [-round(self.rng.uniform(0.01, 3.0), 3) for _ in ids]
        event = LLMCalled(agent=agent, call_id=call_id or f"call-{self.calls}",
                          messages=[dict(m) for m in messages], tools=call_tools,
                          prompt_ids=prompt_ids, response_ids=ids, logprobs=logprobs,
                          response=dict(response), finish_reason=finish_reason)
        self.events.append(event)
        return event

    def tool(self, name: str, output: str, *, agent: str = "main", error_type: str | None = None
             ) -> None:
        self.events.append(ToolReturned(agent=agent, name=name, output=output,
                                        is_error=error_type is not None, error_type=error_type,
                                        error_message=output if error_type else None))

    def checkpoint(self, position_key: str, *, agent: str = "main", retry_count: int = 0
                   ) -> str:
        checkpoint_id = uuid.uuid4().hex
        self.events.append(CheckpointCreated(agent=agent, checkpoint_id=checkpoint_id,
                                             position_key=position_key,
                                             retry_count=retry_count))
        return checkpoint_id

    def failed(self, checkpoint_id: str, position_key: str, *, retry_index: int,
               failed_call_id: str | None, errors: list[str], error_types: list[str],
               tool_calls: list[dict[str, Any]] | None = None, agent: str = "main") -> None:
        self.events.append(AttemptFailed(
            agent=agent, checkpoint_id=checkpoint_id, position_key=position_key,
            retry_index=retry_index, error_messages=errors, error_types=error_types,
            failed_tool_calls=tool_calls or [], failed_call_id=failed_call_id))

    def rolled_back(self, checkpoint_id: str, discarded: list[str], *, agent: str = "main"
                    ) -> None:
        self.events.append(RolledBack(agent=agent, checkpoint_id=checkpoint_id,
                                      discarded_call_ids=discarded))

    def finish(self, reward: float, status: str = "completed") -> list[Event]:
        self.events.append(RewardAssigned(value=reward))
        self.events.append(EpisodeFinished(status=status))
        return self.events
