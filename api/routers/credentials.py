"""Credentials of one episode: a rollout worker that writes through the API (no database of
its own) mints the short-lived key a user's RolloutServer records one episode with, and
revokes it when the episode ends (``workers.rollout.credentials``). Minting a key is an
administrator's act, so both routes need an ``admin`` key of the episode's project."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.deps import AdminKey, Ctx
from api.errors import ERROR_RESPONSES, ApiError
from api.schemas.credentials import CredentialCreate, CredentialCreated
from store import queries

__all__ = ["router"]

router = APIRouter(tags=["keys"], responses=ERROR_RESPONSES)


@router.post("/v1/episodes/{episode_id}/credentials", status_code=201,
             response_model=CredentialCreated,
             responses={409: ERROR_RESPONSES[422] | {
                 "description": "The episode is finished (`episode_finished`)."}})
def mint_credential(episode_id: str, body: CredentialCreate, key: AdminKey, ctx: Ctx
                    ) -> CredentialCreated:
    """Mint a credential that may record only this episode (the ``ingest`` key of a user's
    RolloutServer: the completions endpoints, the completion report, the model list and the
    episode's own paths) and expires ``ttl_s`` seconds from now. Bad input: a key that is
    not ``admin`` is 403; an unknown episode 404 naming it; another project's episode 403;
    a finished episode 409 ``episode_finished``; ``ttl_s`` out of [1, 86460] 422 naming
    ``body.ttl_s``. Nothing is stored then."""
    run_id = ctx.access.check_episode(key, episode_id)
    if queries.episode_finished(ctx.store, episode_id):
        raise ApiError(409, "episode_finished", f"episode {episode_id!r} is finished: its "
                                                "rollout is over and takes no credential")
    minted = ctx.keys.mint_episode(project=key.project, run_id=run_id, episode_id=episode_id,
                                   ttl_s=body.ttl_s)
    return CredentialCreated(key_id=minted.key_id, token=minted.token,
                             expires_at=minted.expires_at)


@router.delete("/v1/episodes/{episode_id}/credentials/{key_id}", status_code=204,
               response_class=Response)
def revoke_credential(episode_id: str, key_id: str, key: AdminKey, ctx: Ctx) -> Response:
    """Revoke a credential of this episode at once, in every API process (revoking twice is
    harmless: 204 again). An unknown episode, or a key that is not a credential of this
    episode (unknown, or another episode's, or a key of the whole project), is 404 naming
    it; another project's episode 403."""
    ctx.access.check_episode(key, episode_id)
    ctx.keys.revoke_episode(episode_id, key_id)
    return Response(status_code=204)
