"""``/ui`` served as HTML against the seeded store: sign-in and keys, every page's numbers
(the same as the analytics views and the replay), token colouring, error pages."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.keys import KeyStore
from api.ui.routes import COOKIE
from store import analytics
from store.analytics import Filters
from store.settings import Settings
from tests.analytics.conftest import OTHER, RUN, Seeded
from workers.engines.tokenizers import load_tokenizer
from workers.replay import replay_episode


@pytest.fixture(scope="module")
def ui(seeded: Seeded, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[tuple[TestClient, dict[str, str]]]:
    settings = Settings(database_url=seeded.url, data_dir=Path(tmp_path_factory.mktemp("ui")),
                        api_key_scrypt_n=1024)
    keys = KeyStore(seeded.db, settings)
    tokens = {"read": keys.create(project="default", role="read").token,
              "admin": keys.create(project="default", role="admin").token,
              "ingest": keys.create(project="default", role="ingest").token,
              "stranger": keys.create(project="elsewhere", role="read").token}
    revoked = keys.create(project="default", role="read")
    keys.revoke(revoked.key.key_id)
    tokens["revoked"] = revoked.token
    keys.close()
    with TestClient(create_app(settings, store=seeded.store)) as client:
        yield client, tokens


def page(ui: tuple[TestClient, dict[str, str]], path: str, key: str = "read") -> Any:
    client, tokens = ui
    return client.get(path, headers={"Authorization": f"Bearer {tokens[key]}"},
                      follow_redirects=False)


def cells(text: str, table: str) -> list[list[str]]:
    """Text of each body row's cells of the table with id ``table``."""
    body = re.search(rf'<table class="grid" id="{table}">.*?<tbody>(.*?)</tbody>', text, re.S)
    assert body, f"no table {table}"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.S)
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)] for r in rows]


def test_without_a_key_the_pages_ask_for_one(ui: tuple[TestClient, dict[str, str]]) -> None:
    client, _ = ui
    r = client.get(f"/ui/runs/{RUN}?x=1", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/ui/login?next=%2Fui%2Fruns%2Frun-analytics%3Fx%3D1"
    form = client.get(r.headers["location"])
    assert form.status_code == 200 and 'name="key"' in form.text
    assert 'value="/ui/runs/run-analytics?x=1"' in form.text


@pytest.mark.parametrize("key,status,message", [
    ("revoked", 401, "unknown, malformed or revoked"),
    ("ingest", 403, "role &#39;ingest&#39;"),
])
def test_login_refuses_bad_keys(ui: tuple[TestClient, dict[str, str]], key: str, status: int,
                                message: str) -> None:
    client, tokens = ui
    r = client.post("/ui/login", data={"key": tokens[key], "next": "/ui"},
                    follow_redirects=False)
    assert r.status_code == status and message in r.text
    assert COOKIE not in r.cookies
    r = client.post("/ui/login", data={"key": "nonsense"}, follow_redirects=False)
    assert r.status_code == 401


def test_login_keeps_a_session_not_the_key(ui: tuple[TestClient, dict[str, str]],
                                           seeded: Seeded) -> None:
    client, tokens = ui
    r = client.post("/ui/login", data={"key": tokens["admin"], "next": "https://evil.example/"},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui"  # never off-site
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    session = r.cookies[COOKIE]
    assert session.startswith("tss1.") and tokens["admin"] not in cookie
    secret = tokens["admin"].rsplit("_", 1)[1]
    assert secret not in session
    client.cookies.clear()
    client.cookies.set(COOKIE, session, path="/ui")
    try:
        page_answer = client.get("/ui", follow_redirects=False)
        assert page_answer.status_code == 200
        # Every page: own scripts only, never framed, no sniffing.
        assert "script-src 'self'" in page_answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in page_answer.headers["content-security-policy"]
        assert page_answer.headers["x-frame-options"] == "DENY"
        assert page_answer.headers["x-content-type-options"] == "nosniff"
        # A tampered session is no session.
        client.cookies.clear()
        client.cookies.set(COOKIE, session[:-1] + ("0" if session[-1] != "0" else "1"),
                           path="/ui")
        assert client.get("/ui", follow_redirects=False).status_code == 303
        client.cookies.clear()
        client.cookies.set(COOKIE, session, path="/ui")
        out = client.post("/ui/logout", follow_redirects=False)
        assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]
    finally:
        client.cookies.clear()
    # The cookie is only good for the pages: the REST API still wants a header.
    rest = client.get("/v1/runs", headers={"Cookie": f"{COOKIE}={session}"})
    assert rest.status_code == 401


def test_a_session_ends_with_its_key(ui: tuple[TestClient, dict[str, str]],
                                     seeded: Seeded) -> None:
    client, _ = ui
    keys = KeyStore(seeded.db, client.app.state.ctx.settings)
    made = keys.create(project="default", role="read")
    r = client.post("/ui/login", data={"key": made.token, "next": "/ui"},
                    follow_redirects=False)
    session = r.cookies[COOKIE]
    client.cookies.clear()
    client.cookies.set(COOKIE, session, path="/ui")
    try:
        assert client.get("/ui", follow_redirects=False).status_code == 200
        keys.revoke(made.key.key_id)
        assert client.get("/ui", follow_redirects=False).status_code == 303
    finally:
        client.cookies.clear()
        keys.close()


def test_a_sign_in_from_another_site_is_refused(ui: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = ui
    for header in ({"Origin": "https://evil.example"},
                   {"Referer": "https://evil.example/form"}):
        r = client.post("/ui/login", data={"key": tokens["read"], "next": "/ui"},
                        headers=header, follow_redirects=False)
        assert r.status_code == 403 and COOKIE not in r.cookies
    same = client.post("/ui/login", data={"key": tokens["read"], "next": "/ui"},
                       headers={"Origin": str(client.base_url)}, follow_redirects=False)
    assert same.status_code == 303


def test_runs_page_lists_the_projects_runs(ui: tuple[TestClient, dict[str, str]]) -> None:
    r = page(ui, "/ui")
    assert r.status_code == 200
    rows = {row[0]: row for row in cells(r.text, "runs")}
    assert set(rows) == {RUN, OTHER}
    # 6 episodes, 5 completed (e3 ends terminated)
    assert rows[RUN][4] == "6" and rows[RUN][5] == "5"
    other = page(ui, "/ui", key="stranger")
    assert "No runs in project elsewhere" in other.text


def test_run_dashboard_agrees_with_the_views(ui: tuple[TestClient, dict[str, str]],
                                            seeded: Seeded) -> None:
    r = page(ui, f"/ui/runs/{RUN}")
    assert r.status_code == 200
    failures = analytics.failure_patterns(seeded.db, Filters(run_id=RUN))
    shown = cells(r.text, "failures")
    assert [(int(c[0]), c[1], c[2], c[3], int(c[4])) for c in shown] == [
        (f.policy_version, f.tool_name, f.error_type, f.position_key, f.failures)
        for f in failures]
    total = re.search(r'id="total-failures">(\d+)<', r.text)
    assert total and int(total.group(1)) == sum(f.failures for f in failures) == 9
    groups = {c[0]: c for c in cells(r.text, "groups")}
    assert list(groups) == ["g1", "g2", "g3"]
    assert groups["g2"][1:4] == ["2", "2", "1"]  # e3 terminated, e4 completed
    rollbacks = cells(r.text, "rollbacks")
    want = analytics.rollback_outcomes(seeded.db, Filters(run_id=RUN))
    assert [int(c[3]) for c in rollbacks] == [w.rollbacks for w in want]
    signatures = cells(r.text, "signatures")
    assert any("TypeError: unexpected argument" in c[2] for c in signatures)
    # The chart data is the views' numbers by policy version.
    charts = re.search(r'<script type="application/json" id="chart-data">(.*?)</script>',
                       r.text, re.S)
    assert charts
    data = __import__("json").loads(html.unescape(charts.group(1)))
    assert data["versions"] == [0, 1]
    by_type = {s["label"]: s["data"] for s in data["failures_by_error_type"]}
    assert by_type == {"TypeError": [3, 1], "NameError": [4, 0], "ZeroDivisionError": [1, 0]}
    assert data["reward"] == [pytest.approx(0.5), pytest.approx(0.75)]
    assert '<script src="/ui/static/vendor/chart.umd.min.js">' in r.text


def test_group_page_lists_its_episodes(ui: tuple[TestClient, dict[str, str]],
                                       seeded: Seeded) -> None:
    r = page(ui, f"/ui/runs/{RUN}/groups/g2")
    assert r.status_code == 200
    rows = cells(r.text, "episodes")
    assert [row[0] for row in rows] == [seeded.ids["e3"], seeded.ids["e4"]]
    assert [row[2] for row in rows] == ["terminated", "completed"]
    assert page(ui, f"/ui/runs/{RUN}/groups/nope").status_code == 404


def test_episode_page_colours_exactly_the_trained_tokens(
        ui: tuple[TestClient, dict[str, str]], seeded: Seeded) -> None:
    episode = seeded.ids["e1"]
    r = page(ui, f"/ui/episodes/{episode}")
    assert r.status_code == 200, r.text
    spans = re.findall(r'<span class="t m(\d)" data-i="(\d+)" data-id="(\d+)" '
                       r'data-lp="([-\d.]+)"', r.text.split('id="negatives"')[0])
    from store.events import RunConfig

    result = replay_episode(seeded.events["e1"], config=RunConfig(tokenizer="qwen3"),
                            tokenizer=load_tokenizer("qwen3"), episode_id=episode)
    assert result.samples
    ids = [t for sample in result.samples for t in sample.token_ids]
    mask = [m for sample in result.samples for m in sample.loss_mask]
    logprobs = [lp for sample in result.samples for lp in sample.logprobs]
    assert [int(s[2]) for s in spans] == ids
    assert [int(s[0]) for s in spans] == mask and 0 < sum(mask) < len(mask)
    trained = [float(s[3]) for s in spans if s[0] == "1"]
    want = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
    assert trained == pytest.approx(want, abs=1e-4)
    # The rolled-back attempt is a negative sample with its error, and the event log flags it.
    assert 'id="negatives"' in r.text and "TypeError" in r.text
    assert r.text.count('class="badge rollback"') == len(result.failures) == 1
    assert '<tr class="rollback">' in r.text and '<tr class="error">' in r.text
    assert "search(" in r.text  # the tool call inline
    # The rolled-back call is in the retry's timeline as context: flagged, no token trained.
    assert result.discarded_indices and result.discarded_context
    timelines = r.text.split('id="negatives"')[0]
    discarded = re.findall(r'<article class="msg [^"]*discarded[^"]*">(.*?)</article>',
                           timelines, re.S)
    assert len(discarded) == sum(map(len, result.discarded_context.values())) == 1
    assert "discarded call · context, not trained" in discarded[0]
    marks = re.findall(r'<span class="t m(\d)"', discarded[0])
    assert marks and set(marks) == {"0"}
    (call,) = [result.call_ids[i] for i in result.discarded_indices]
    assert re.search(rf'id="discarded-calls">{call}<', r.text)


def test_error_pages(ui: tuple[TestClient, dict[str, str]], seeded: Seeded) -> None:
    assert page(ui, "/ui/runs/no-such-run").status_code == 404
    assert page(ui, "/ui/episodes/no-such-episode").status_code == 404
    r = page(ui, f"/ui/runs/{RUN}", key="stranger")
    assert r.status_code == 403 and "not in this key" in r.text
    assert page(ui, f"/ui/episodes/{seeded.ids['e1']}", key="stranger").status_code == 403
    # An episode replay refuses (e8: corrupted prompt) shows why, and its events.
    r = page(ui, f"/ui/episodes/{seeded.ids['e8']}")
    assert r.status_code == 200, r.text
    assert "Replay refused this episode" in r.text
    from store import queries

    # The projection's reason is the one shown.
    reason = queries.episode_row(seeded.store, seeded.ids["e8"])["invalid_reason"]
    assert reason and reason in html.unescape(r.text), reason
    assert len(cells(r.text, "call-rows")) == sum(
        e.type == "llm_called" for e in seeded.events["e8"])
    assert 'id="events"' in r.text and "episode_finished" in r.text
    assert page(ui, "/ui/static/vendor/chart.umd.min.js").status_code == 200
