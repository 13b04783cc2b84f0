"""API keys: format, hashing, verification, revocation, and the ``trajstore keys`` CLI."""

from __future__ import annotations

import hashlib
import re

import pytest
from typer.testing import CliRunner

from api.keys import KEY_PREFIX, KeyStore, hash_secret, parse_key
from store import errors
from store.settings import Settings, get_settings


def test_key_is_stored_as_a_scrypt_hash_with_default_cost(key_store: KeyStore,
                                                          pg_url: str) -> None:
    keys = KeyStore(key_store.db, Settings(database_url=pg_url, api_key_cache_s=0))
    new = keys.create(project="p-hash", role="read", name="ci")
    key_id, secret = parse_key(new.token)
    assert new.token.startswith(KEY_PREFIX) and key_id == new.key.key_id
    with key_store.db.connection() as conn:
        stored, salt, params = conn.execute(
            "SELECT secret_hash, salt, hash_params FROM api_keys WHERE key_id = %s",
            (key_id,)).fetchone()
    assert params == "scrypt$16384$8$1"
    assert bytes(stored) == hashlib.scrypt(secret.encode(), salt=bytes(salt), n=16384, r=8,
                                           p=1, dklen=32)
    assert secret.encode() not in bytes(stored) and len(secret) == 43
    assert keys.verify(new.token) == new.key
    # A fresh store (no cache) checks the hash itself; a wrong secret fails.
    assert KeyStore(key_store.db, keys.settings).verify(new.token) == new.key
    assert keys.verify(new.token[:-1] + ("A" if new.token[-1] != "A" else "B")) is None


def test_keys_made_with_other_parameters_still_verify(key_store: KeyStore, pg_url: str
                                                      ) -> None:
    old = key_store.create(project="p-params", role="ingest")  # n=1024 in these tests
    later = KeyStore(key_store.db, Settings(database_url=pg_url, api_key_scrypt_n=4096,
                                             api_key_cache_s=0))
    assert later.verify(old.token) == old.key


def test_list_and_revoke(key_store: KeyStore) -> None:
    a = key_store.create(project="p-list", role="ingest", name="agent")
    b = key_store.create(project="p-list", role="admin")
    assert [k.key_id for k in key_store.list(project="p-list")] == [a.key.key_id,
                                                                     b.key.key_id]
    revoked = key_store.revoke(a.key.key_id)
    assert revoked.revoked_at is not None
    assert key_store.revoke(a.key.key_id).revoked_at == revoked.revoked_at
    assert [k.key_id for k in key_store.list(project="p-list")] == [b.key.key_id]
    assert len(key_store.list(project="p-list", include_revoked=True)) == 2
    assert key_store.verify(a.token) is None
    with pytest.raises(errors.NotFoundError, match="no API key 'ffffffffffffffff'"):
        key_store.revoke("ffffffffffffffff")


@pytest.mark.parametrize("project, role, message", [
    ("", "read", "project must be a non-empty string"),
    ("x" * 201, "read", "at most 200 characters"),
    ("p", "owner", "role must be one of ingest, read, train, admin, got 'owner'"),
])
def test_create_refuses_bad_input(key_store: KeyStore, project: str, role: str,
                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        key_store.create(project=project, role=role)


@pytest.mark.parametrize("token, message", [
    ("sk-abc", "starts with 'tsk_'"),
    ("tsk_nothex0123456789_" + "a" * 43, "tsk_<16 hex digits>_<secret>"),
    ("tsk_0123456789abcdef_short", "secret part"),
    ("tsk_0123456789abcdef-" + "a" * 43, "tsk_<16 hex digits>_<secret>"),
])
def test_parse_key_refuses_malformed_keys(token: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_key(token)


def test_hash_secret_refuses_bad_cost() -> None:
    with pytest.raises(ValueError, match="power of 2"):
        hash_secret("s", salt=b"x" * 16, n=1000, r=8, p=1)
    with pytest.raises(ValueError, match="api_key_scrypt_n must be a power of 2"):
        Settings(api_key_scrypt_n=3000)


@pytest.fixture
def cli_env(pg_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", pg_url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRAJSTORE_API_KEY_SCRYPT_N", "1024")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_cli_creates_lists_and_revokes_keys(cli_env: None, key_store: KeyStore) -> None:
    from trajstore.cli import app

    runner = CliRunner()
    made = runner.invoke(app, ["keys", "create", "--project", "p-cli", "--role", "ingest",
                               "--name", "agents"])
    assert made.exit_code == 0, made.output
    token = re.search(r"^(tsk_\S+)$", made.output, re.M).group(1)  # type: ignore[union-attr]
    key = key_store.verify(token)
    assert key is not None and key.project == "p-cli" and key.role == "ingest"
    listed = runner.invoke(app, ["keys", "list", "--project", "p-cli"])
    assert listed.exit_code == 0 and key.key_id in listed.output and "agents" in listed.output
    assert token not in listed.output
    revoked = runner.invoke(app, ["keys", "revoke", key.key_id])
    assert revoked.exit_code == 0 and f"revoked {key.key_id}" in revoked.output
    assert key_store.verify(token) is None
    assert key.key_id not in runner.invoke(app, ["keys", "list", "--project", "p-cli"]).output
    assert key.key_id in runner.invoke(app, ["keys", "list", "--revoked"]).output
    bad = runner.invoke(app, ["keys", "create", "--project", "p", "--role", "owner"])
    assert bad.exit_code == 2 and "--role" in bad.output
    assert "'owner' is not one of 'ingest', 'read', 'train', 'admin'" in bad.output
    trainer = runner.invoke(app, ["keys", "create", "--project", "p-cli", "--role", "train"])
    assert trainer.exit_code == 0, trainer.output
    token = re.search(r"^(tsk_\S+)$", trainer.output, re.M).group(1)  # type: ignore[union-attr]
    key = key_store.verify(token)
    assert key is not None and key.role == "train" and "role:    train" in trainer.output
    missing = runner.invoke(app, ["keys", "revoke", "0000000000000000"])
    assert missing.exit_code == 1 and "no API key" in missing.output
