"""``/ui`` in headless Chromium (Debian's ``chromium``, driven by Playwright) against a real
``trajstore serve`` process on the seeded store: sign in, walk runs → run → group → episode,
check what the pages show, hover a token, and take screenshots whose charts and token
colours are checked pixel by pixel. Every request the browser makes must stay on the
server: the page needs no external network.

Without a ``chromium`` binary the tests are skipped, except under CI (``CI`` set), where
they fail: ``.ci/run`` installs it.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from api.keys import KeyStore
from store.settings import Settings
from tests.analytics.conftest import RUN, Seeded
from tests.api.conftest import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI needs Debian's chromium for the UI tests: apt-get install chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary")


@pytest.fixture(scope="module")
def served(seeded: Seeded, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Server, str]]:
    folder = Path(tmp_path_factory.mktemp("ui-browser"))
    settings = Settings(database_url=seeded.url, data_dir=folder, api_key_scrypt_n=1024)
    keys = KeyStore(seeded.db, settings)
    token = keys.create(project="default", role="read").token
    keys.close()
    server = Server(settings, folder / "server.log")
    try:
        server.wait_ready()
        yield server, token
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def tab(browser: Any, served: tuple[Server, str]) -> Iterator[tuple[Any, list[str]]]:
    """A fresh page (no cookies) and the URLs of every request it makes."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page, requests
    context.close()
    assert errors == [], f"JavaScript errors: {errors}"
    server, _ = served
    hosts = {urlsplit(u).netloc for u in requests if not u.startswith(("data:", "blob:"))}
    assert hosts <= {urlsplit(server.url).netloc}, f"requests left the server: {hosts}"


def sign_in(page: Any, served: tuple[Server, str], path: str = "/ui") -> None:
    server, token = served
    page.goto(server.url + path)
    assert "/ui/login" in page.url
    page.fill("input[name=key]", token)
    page.click("button[type=submit]")
    page.wait_for_url(server.url + path)


def colours(png: bytes) -> set[tuple[int, int, int]]:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return {c for _, c in image.getcolors(maxcolors=1 << 20) or []}


def near(found: set[tuple[int, int, int]], hex_colour: str, tolerance: int = 6) -> bool:
    want = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return any(all(abs(a - b) <= tolerance for a, b in zip(c, want, strict=True))
               for c in found)


def test_sign_in_and_walk_to_an_episode(tab: tuple[Any, list[str]],
                                        served: tuple[Server, str], seeded: Seeded) -> None:
    page, _ = tab
    sign_in(page, served)
    assert page.locator("#runs tbody tr").count() == 2
    page.click(f"text={RUN}")
    page.wait_for_selector("body[data-charts=ready]")
    assert page.locator("#total-failures").inner_text() == "9"
    assert page.locator("#groups tbody tr").count() == 3
    page.click("#groups >> text=g1")
    assert page.locator("#episodes tbody tr").count() == 2
    page.click(f"text={seeded.ids['e1']}")
    page.wait_for_selector(".timeline")
    # e1's failed search was rolled back: it is a negative sample, not part of the timeline.
    assert page.locator("#negatives .badge.rollback").count() == 1
    assert "TypeError" in page.locator("#negatives .errline").first.inner_text()
    assert page.locator("#events tr.rollback").count() >= 1
    trained = page.locator(".timeline .t.m1")
    assert trained.count() > 0 and page.locator(".timeline .t.m0").count() > trained.count()
    first = trained.first
    first.hover()
    inspector = page.locator("#inspector")
    assert inspector.is_visible()
    text = inspector.inner_text()
    assert f"id {first.get_attribute('data-id')}" in text
    assert f"logprob {first.get_attribute('data-lp')}" in text
    page.locator(".timeline .t.m0").first.hover()
    assert "not trained" in inspector.inner_text()

    # e4's division by zero was not rolled back: the error shows inline in the timeline.
    page.goto(served[0].url + f"/ui/episodes/{seeded.ids['e4']}")
    error = page.locator("article.msg.tool-error")
    assert error.count() == 1
    assert "ZeroDivisionError" in error.inner_text()


def test_wrong_key_and_signed_out_pages(tab: tuple[Any, list[str]],
                                        served: tuple[Server, str]) -> None:
    page, _ = tab
    server, _ = served
    page.goto(server.url + f"/ui/runs/{RUN}")
    assert "/ui/login" in page.url
    page.fill("input[name=key]", "tsk_not_a_key")
    page.click("button[type=submit]")
    assert "unknown, malformed or revoked" in page.locator(".alert").inner_text()
    sign_in(page, served, f"/ui/runs/{RUN}")
    page.click("text=Sign out")
    page.goto(server.url + "/ui")
    assert "/ui/login" in page.url


def test_screenshots_show_the_charts_and_the_token_colours(
        tab: tuple[Any, list[str]], served: tuple[Server, str], seeded: Seeded,
        tmp_path: Path) -> None:
    page, _ = tab
    sign_in(page, served, f"/ui/runs/{RUN}")
    page.wait_for_selector("body[data-charts=ready]")
    charts = page.locator(".charts")
    shot = charts.screenshot(path=str(tmp_path / "dashboard.png"))
    found = colours(shot)
    # Bars of the first two series (error types / tools) and the reward line are drawn.
    for colour in ("#3056d3", "#d9480f", "#2f9e44"):
        assert near(found, colour), f"no {colour} in the dashboard screenshot"
    for canvas in ("chart-error-types", "chart-tools", "chart-reward", "chart-recovery"):
        box = page.locator(f"#{canvas}").bounding_box()
        assert box and box["width"] > 200 and box["height"] > 150, canvas

    page.goto(served[0].url + f"/ui/episodes/{seeded.ids['e1']}")
    timeline = page.locator(".timeline").first
    found = colours(timeline.screenshot(path=str(tmp_path / "episode.png")))
    assert near(found, "#c9f2d0"), "trained tokens are not coloured"
    assert near(found, "#eef0f4"), "context tokens are not coloured"
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def _fits(page: Any) -> bool:
    """Whether the page is no wider than the window (wide tables scroll in their box)."""
    return bool(page.evaluate(
        "document.documentElement.scrollWidth <= document.documentElement.clientWidth"))


def test_search_a_refused_episode_and_tables_that_fit(
        browser: Any, served: tuple[Server, str], seeded: Seeded) -> None:
    """At 800 pixels wide, the dashboard (tables of ten and more columns), an episode and the
    search results fit the window; the search box finds episodes by an error's text; an
    episode replay refused shows the reason and its events."""
    context = browser.new_context(viewport={"width": 800, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        sign_in(page, served, f"/ui/runs/{RUN}")
        page.wait_for_selector("body[data-charts=ready]")
        assert _fits(page)
        wide = page.locator("#rollbacks")
        assert wide.evaluate("t => t.parentElement.scrollWidth > t.parentElement.clientWidth")
        page.fill("input[name=q]", "unexpected argument")
        page.press("input[name=q]", "Enter")
        page.wait_for_selector("#matches")
        assert page.locator("#matches tbody tr").count() == 4
        assert _fits(page)
        page.click(f"#matches >> text={seeded.ids['e1']}")
        page.wait_for_selector(".timeline")
        assert _fits(page)
        assert page.locator("#call-rows tbody tr").count() >= 2
        page.goto(served[0].url + f"/ui/episodes/{seeded.ids['e8']}")
        refused = page.locator("#refused")
        assert refused.is_visible() and "not a rendering" in refused.inner_text()
        assert page.locator("#events tbody tr").count() == len(seeded.events["e8"])
        assert _fits(page)
    finally:
        context.close()
    assert errors == [], f"JavaScript errors: {errors}"


def test_a_failed_call_is_flagged(browser: Any, migrated_db: str, tmp_path: Path) -> None:
    """An episode whose second LLM call failed (rate limited), on a server and database of
    its own: its row in the calls table and in the event log is flagged, in the error
    colour."""
    import uuid

    from store.db import Database
    from store.eventlog import NO_STREAM, EventStore, run_stream_id
    from store.events import EpisodeFinished, EpisodeStarted, LLMCalled, RunCreated

    url = migrated_db
    settings = Settings(database_url=url, data_dir=tmp_path, api_key_scrypt_n=1024)
    store = EventStore(Database(url, max_size=2), settings)
    run, episode = f"flag-{uuid.uuid4().hex[:6]}", f"flag-ep-{uuid.uuid4().hex[:6]}"
    question = [{"role": "user", "content": "Hi"}]
    store.append(run_stream_id(run), [RunCreated(run_id=run, project="flagged")], NO_STREAM)
    store.append(episode, [
        EpisodeStarted(run_id=run, group_id="g", messages=question),
        LLMCalled(call_id="ok", messages=question, prompt_ids=[], response_ids=[],
                  logprobs=[], response={"role": "assistant", "content": "Hello"},
                  latency_ms=80.0, usage={"prompt_tokens": 9, "completion_tokens": 2}),
        LLMCalled(call_id="bad", messages=question, prompt_ids=[], response_ids=[],
                  logprobs=[], finish_reason="error", latency_ms=30.0,
                  response={"role": "assistant", "content": "",
                            "error": {"type": "RateLimitError", "message": "slow down"}}),
        EpisodeFinished(status="error")], NO_STREAM)
    keys = KeyStore(store.db, settings)
    token = keys.create(project="flagged", role="read").token
    keys.close()
    server = Server(settings, tmp_path / "server.log")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        server.wait_ready()
        page.goto(server.url + f"/ui/episodes/{episode}")
        page.fill("input[name=key]", token)
        page.click("button[type=submit]")
        page.wait_for_selector("#call-rows")
        rows = page.locator("#call-rows tbody tr")
        assert rows.count() == 2
        assert "80" in rows.nth(0).inner_text() and "failed" not in rows.nth(0).inner_text()
        bad = rows.nth(1)
        assert "failed" in bad.inner_text() and "RateLimitError: slow down" in bad.inner_text()
        shot = colours(bad.screenshot())
        assert near(shot, "#fdecea"), "the failed call's row is not in the error colour"
        assert page.locator("#events tr.error").count() == 1
    finally:
        context.close()
        server.stop()
        store.close()
