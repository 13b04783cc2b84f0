"""The run's configuration is the one source of how a group is played: its size is the
run's ``group_size`` and its prompts are rendered with the run's tokenizer and chat template,
so replay, which renders with the same two, segments every rolled-out call of a run whose
template is not the model's own."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import LLMCalled, RunConfig, RunCreated
from workers.engines.backend import SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.chat_template import CHAT_TEMPLATE
from workers.engines.prompt import RunPrompt, run_prompt
from workers.engines.render import prompt_ids
from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer
from workers.replay.episode import replay_episode
from workers.replay.errors import ReplayError
from workers.rollout.agent_tasks import function_call_tasks
from workers.rollout.group import play_group
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.tools import ToolRegistry

MARK = "Answer in one line."
#: The tiny model's template with a system line of the run's own before every prompt.
CUSTOM = "{{- '<|im_start|>system\\n" + MARK + "<|im_end|>\\n' }}\n" + CHAT_TEMPLATE
TASK = function_call_tasks(1, seed=3)[0]


def _run(store: EventStore, **config: Any) -> tuple[str, RunConfig]:
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    run_config = RunConfig(**config)
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=run_config)],
                 NO_STREAM)
    return run_id, run_config


def _play(store: EventStore, backend: TransformersBackend, registry: ToolRegistry,
          run_id: str) -> Any:
    return play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK, backend=backend,
                      tools=registry, policy_version=0,
                      sampling=SamplingParams(temperature=1.0, max_tokens=16), max_turns=2)


def test_rollout_and_replay_render_the_same_prompt_with_the_runs_template(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path) -> None:
    run_id, config = _run(store, group_size=2, tokenizer=str(tiny_model_dir),
                          chat_template=CUSTOM)
    result = _play(store, hf_backend, registry, run_id)
    assert len(result.slots) == 2 and result.played == 2  # the run's group_size
    tokenizer = load_tokenizer(config.tokenizer_name)
    for slot in result.slots:
        events = [r.event for r in store.get_episode(slot.episode_id)]
        calls = [e for e in events if isinstance(e, LLMCalled)]
        assert calls
        for call in calls:
            ours = prompt_ids(tokenizer, call.messages, tools=call.tools, chat_template=CUSTOM)
            model_own = prompt_ids(tokenizer, call.messages, tools=call.tools)
            assert call.prompt_ids.tolist() == ours
            assert ours != model_own  # the test would fail if rollout used the model's
            assert tokenizer.decode(call.prompt_ids.tolist()).startswith(
                f"<|im_start|>system\n{MARK}")
        replayed = replay_episode(events, config=config, tokenizer=tokenizer,
                                  episode_id=slot.episode_id)
        assert replayed.samples
        for sample in replayed.samples:
            first = calls[sample.timeline_index]
            assert sample.token_ids[:len(first.prompt_ids)] == first.prompt_ids.tolist()
        # Replay checks the rendering: the model's own template does not segment these ids.
        with pytest.raises(ReplayError):
            replay_episode(events, config=config.model_copy(update={"chat_template": None}),
                           tokenizer=tokenizer, episode_id=slot.episode_id)


def test_a_run_naming_nothing_is_rendered_by_the_backend(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    run_id, config = _run(store, group_size=1)
    assert run_prompt(config, backend=hf_backend) is None
    result = _play(store, hf_backend, registry, run_id)
    assert len(result.slots) == 1
    call = next(r.event for r in store.get_episode(result.slots[0].episode_id)
                if isinstance(r.event, LLMCalled))
    assert call.prompt_ids.tolist() == prompt_ids(hf_backend.tokenizer, call.messages,
                                                  tools=call.tools)


def test_a_template_without_a_tokenizer_name_uses_the_backends_tokenizer(
        hf_backend: TransformersBackend) -> None:
    prompt = run_prompt(RunConfig(chat_template=CUSTOM), backend=hf_backend)
    assert isinstance(prompt, RunPrompt) and prompt.tokenizer is hf_backend.tokenizer
    ids = prompt.ids([{"role": "user", "content": "hi"}])
    assert hf_backend.tokenizer.decode(ids).startswith(f"<|im_start|>system\n{MARK}")
    with pytest.raises(ValueError, match="names no tokenizer"):
        run_prompt(RunConfig(chat_template=CUSTOM), backend=object())


def test_a_tokenizer_that_cannot_be_loaded_fails_the_group_before_any_episode(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tmp_path: Path) -> None:
    run_id, _ = _run(store, group_size=1, tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(TokenizerNotFound, match="nowhere"):
        _play(store, hf_backend, registry, run_id)
    assert store.list_episodes(run_id) == []


def test_a_template_that_refuses_a_request_ends_that_episode_as_an_error(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path) -> None:
    run_id, _ = _run(store, group_size=1, tokenizer=str(tiny_model_dir),
                     chat_template="{{ raise_exception('refused by the run template') }}")
    result = _play(store, hf_backend, registry, run_id)
    assert result.slots[0].status == "error"
    finished = store.get_episode(result.slots[0].episode_id)[-1].event
    assert "refused by the run template" in (finished.reason or "")


def test_run_prompt_refuses_bad_input(hf_backend: TransformersBackend) -> None:
    with pytest.raises(TypeError, match="chat_template must be a string"):
        RunPrompt(hf_backend.tokenizer, chat_template=3)  # type: ignore[arg-type]

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat_template"):
        RunPrompt(NoTemplate())


def test_tokenizer_name_is_the_tokenizer_else_the_model() -> None:
    assert RunConfig().tokenizer_name is None
    assert RunConfig(model="/m").tokenizer_name == "/m"
    assert RunConfig(model="/m", tokenizer="qwen3").tokenizer_name == "qwen3"


def test_the_rollout_task_takes_no_group_size() -> None:
    """The group size comes from the run: a message in the older form, with the size as a
    third argument, fails before anything is played instead of naming another group."""
    import inspect

    from workers.rollout.celery_tasks import rollout_group

    parameters = inspect.signature(rollout_group.run).parameters
    assert list(parameters) == ["run_id", "task_id", "group_index", "policy_version", "budget"]
    for name in ("group_index", "policy_version", "budget"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError):
        rollout_group("run-x", "arith-0-0", 2)
