"""The OpenAI-compatible capture gateway: ``/v1/chat/completions`` and ``/v1/completions``.

``X-Trajstore-Episode`` names the episode a call is recorded into (none: the call is
answered and not recorded). With ``X-Trajstore-Run`` too, an episode that does not exist yet
is created on the first call (and the run, in the key's project, when it does not exist);
``X-Trajstore-Group`` names its GRPO group (default: the episode id). The same ids can come
in the path instead, as Agent Lightning's proxy takes them:
``/v1/runs/{run}/episodes/{episode}/chat/completions`` (and ``/completions``), so an agent
needs only a base URL. ``GET /v1/models`` lists the model the gateway serves.
``X-Trajstore-Agent`` names the agent (default ``main``);
``X-Trajstore-Policy-Version`` the weights version that answered, when the caller knows it
better than the episode does. Tool results in a chat history become ``tool_returned``
facts, and ``X-Trajstore-Abandoned`` marks an earlier call abandoned
(``api.gateway.tool_facts``). A body with ``rollout_id`` is a remote-rollout call
(TrainGate): see ``api.gateway.service``. Its rollout is the episode of that id, created on
its first call when unseen, in the run the header or path names, else the key's run, else
``TRAJSTORE_REMOTE_DEFAULT_RUN``; an id another project uses is 409, naming nothing of it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Response

from api.deps import Ctx, IngestKey
from api.errors import ERROR_RESPONSES
from api.schemas.common import ErrorBody
from api.schemas.openai import ChatCompletionRequest, CompletionRequest, CompletionResponse

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["gateway"], responses={
    **ERROR_RESPONSES,
    404: {"model": ErrorBody, "description": "The episode does not exist, or the rollout "
                                             "does not and no run is named to create it "
                                             "in."},
    409: {"model": ErrorBody, "description": "The episode is finished, a concurrent call "
                                             "of the same rollout was recorded first, or "
                                             "the rollout id is taken."},
    502: {"model": ErrorBody, "description": "The upstream server failed or answered "
                                             "without token ids."},
    503: {"model": ErrorBody, "description": "No generation backend is configured."},
})

_STREAM: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}},
                 "description": "The answer (JSON, or server-sent events with `stream`)."}}

Episode = Annotated[str | None, Header(alias="X-Trajstore-Episode", max_length=200)]
Agent = Annotated[str | None, Header(alias="X-Trajstore-Agent", min_length=1, max_length=200)]
PolicyVersion = Annotated[int | None, Header(alias="X-Trajstore-Policy-Version", ge=0,
                                             le=2**31 - 1)]
Run = Annotated[str | None, Header(alias="X-Trajstore-Run", max_length=200)]
Group = Annotated[str | None, Header(alias="X-Trajstore-Group", max_length=200)]
Abandoned = Annotated[str | None, Header(
    alias="X-Trajstore-Abandoned", min_length=1, max_length=200,
    description="A call id of this agent in this episode, or `previous` (its latest call): "
                "that attempt was thrown away by the client and becomes a negative sample "
                "(or is excluded), never a positive one.")]


def _model_list(ctx: Any) -> dict[str, Any]:
    name = (ctx.settings.gateway_upstream_model or "upstream") if ctx.gateway.has_upstream \
        else ctx.settings.gateway_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "trajstore"}]}


@router.get("/models")
def models(key: IngestKey, ctx: Ctx) -> dict[str, Any]:
    """The model the gateway serves, in OpenAI's list shape: the upstream's model name when
    one is set (else the caller's), or the in-process engine's name."""
    return _model_list(ctx)


def _check_run(ctx: Any, key: Any, run_id: str) -> None:
    """A run that exists must be the key's project's (403); one that does not is the one
    the episode's first call will create, so nothing is refused."""
    from store import queries

    if queries.run_record(ctx.store, run_id) is not None:
        ctx.access.check_run(key, run_id)


@router.get("/runs/{run_id}/episodes/{episode_id}/models")
def episode_models(run_id: str, episode_id: str, key: IngestKey, ctx: Ctx) -> dict[str, Any]:
    """``GET /v1/models`` under an episode's base URL, where an ``openai`` client given that
    base URL asks (``client.models.list()``). It creates nothing; another project's run is
    403."""
    _check_run(ctx, key, run_id)
    return _model_list(ctx)


@router.get("/models/{model_id}")
def model(model_id: str, key: IngestKey, ctx: Ctx) -> dict[str, Any]:
    """One model (``client.models.retrieve``): the one the gateway serves; any other name
    is 404 (with an upstream and no model name set, the caller's name is what is sent, so
    any name is answered)."""
    return _one_model(ctx, model_id)


@router.get("/runs/{run_id}/episodes/{episode_id}/models/{model_id}")
def episode_model(run_id: str, episode_id: str, model_id: str, key: IngestKey,
                  ctx: Ctx) -> dict[str, Any]:
    """``GET /v1/models/{model}`` under an episode's base URL."""
    _check_run(ctx, key, run_id)
    return _one_model(ctx, model_id)


def _one_model(ctx: Any, model_id: str) -> dict[str, Any]:
    from api.errors import ApiError

    served = _model_list(ctx)["data"]
    if ctx.gateway.has_upstream and not ctx.settings.gateway_upstream_model:
        # The caller's model name goes upstream as given: any name is served.
        return {**served[0], "id": model_id}
    for item in served:
        if item["id"] == model_id:
            return dict(item)
    raise ApiError(404, "not_found", f"no model {model_id!r}; this gateway serves "
                                     f"{served[0]['id']!r}")


@router.post("/chat/completions", response_model=CompletionResponse, responses=_STREAM)
async def chat_completions(body: ChatCompletionRequest, key: IngestKey, ctx: Ctx,
                           episode: Episode = None, agent: Agent = None,
                           policy_version: PolicyVersion = None, run: Run = None,
                           group: Group = None, abandoned: Abandoned = None) -> Response:
    """OpenAI chat completions through the capture gateway."""
    return await ctx.gateway.chat(body, key=key, episode=episode or None,
                                  agent=agent or "main", policy_version=policy_version,
                                  run=run or None, group=group or None, abandoned=abandoned)


@router.post("/runs/{run_id}/episodes/{episode_id}/chat/completions",
             response_model=CompletionResponse, responses=_STREAM)
async def episode_chat_completions(run_id: str, episode_id: str, body: ChatCompletionRequest,
                                   key: IngestKey, ctx: Ctx, agent: Agent = None,
                                   policy_version: PolicyVersion = None,
                                   group: Group = None, abandoned: Abandoned = None
                                   ) -> Response:
    """Chat completions recorded into ``episode_id`` of ``run_id``, both created on the
    first call when missing."""
    return await ctx.gateway.chat(body, key=key, episode=episode_id, agent=agent or "main",
                                  policy_version=policy_version, run=run_id,
                                  group=group or None, abandoned=abandoned)


@router.post("/completions", response_model=CompletionResponse, responses=_STREAM)
async def completions(body: CompletionRequest, key: IngestKey, ctx: Ctx,
                      episode: Episode = None, agent: Agent = None,
                      policy_version: PolicyVersion = None, run: Run = None,
                      group: Group = None, abandoned: Abandoned = None) -> Response:
    """OpenAI text completions through the capture gateway (and TrainGate's
    ``/v1/completions`` with ``rollout_id`` and ``messages``)."""
    return await ctx.gateway.completion(body, key=key, episode=episode or None,
                                        agent=agent or "main", policy_version=policy_version,
                                        run=run or None, group=group or None,
                                        abandoned=abandoned)


@router.post("/runs/{run_id}/episodes/{episode_id}/completions",
             response_model=CompletionResponse, responses=_STREAM)
async def episode_completions(run_id: str, episode_id: str, body: CompletionRequest,
                              key: IngestKey, ctx: Ctx, agent: Agent = None,
                              policy_version: PolicyVersion = None,
                              group: Group = None, abandoned: Abandoned = None) -> Response:
    """Text completions recorded into ``episode_id`` of ``run_id`` (created when missing)."""
    return await ctx.gateway.completion(body, key=key, episode=episode_id,
                                        agent=agent or "main", policy_version=policy_version,
                                        run=run_id, group=group or None, abandoned=abandoned)
