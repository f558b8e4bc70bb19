"""The dashboard in a real browser: `sparsecal dashboard` serves the fixture run on a free local
port and Debian's headless Chromium (Playwright) goes through every page, changes a control on
each, and checks that the charts are drawn with no exception or error alert. Screenshots and the
time each page took to be interactive again go to test-artifacts/dashboard/ (git-ignored;
timings are reported, never asserted)."""
import json

import pytest

from sparsecal.dashboard import drive

from helpers import FIXTURE, ROOT, write_results

ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHARTS = {"Overview": 1, "Density": 2, "BLASST": 4, "Stabilization": 4, "Tiles": 3, "Accuracy-speedup": 1,
          "Export": 2}

pytestmark = [pytest.mark.browser,  # out of the fast inner loop (-m "not model and not browser")
              pytest.mark.skipif(not drive.have_chromium(),
                                 reason=f"no Chromium at {drive.CHROMIUM}: `make test` installs it (apt-get install chromium)")]


def _check(page, title: str, when: str, js_errors: list) -> dict:
    rep = drive.page_report(page)
    assert rep["errors"] == [], f"{title} {when}: {rep['errors']}"
    assert rep["charts"] >= CHARTS[title] and rep["charts"] == rep["chart_blocks"], f"{title} {when}: {rep}"
    assert js_errors == [], f"{title} {when}: page errors {js_errors}"
    return rep


def test_every_page_renders_in_chromium(tmp_path):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    results = write_results(tmp_path / "results")
    timings = {}
    with drive.DashboardServer([FIXTURE], results=[results], log_path=ARTIFACTS / "server.log") as srv, \
            sync_playwright() as pw:
        browser = drive.chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            js_errors = []
            page.on("pageerror", lambda e: js_errors.append(str(e)))
            drive.open_app(page, srv.url)
            for n, title in enumerate(drive.PAGES):
                visit_s = drive.visit(page, title)
                _check(page, title, "on arrival", js_errors)
                change_s = drive.change(page, drive.PAGE_ACTIONS[title])
                _check(page, title, f"after {drive.PAGE_ACTIONS[title]}", js_errors)
                page.screenshot(path=str(ARTIFACTS / f"{n + 1}-{title}.png"), full_page=True)
                timings[title] = {"visit_s": round(visit_s, 3), "change_s": round(change_s, 3),
                                  "action": list(drive.PAGE_ACTIONS[title])}
            drive.open_app(page, srv.url + "/overview")  # the default page's own path opens it too
            page.wait_for_selector('[data-testid="stPlotlyChart"] .main-svg', timeout=90_000)
            drive.wait_idle(page, need_run=False)
            assert "Page not found" not in page.inner_text("body")
            _check(page, "Overview", "at /overview", js_errors)
        finally:
            browser.close()
    (ARTIFACTS / "timings.json").write_text(json.dumps(timings, indent=1))
    print(json.dumps(timings, indent=1))
    assert f"http://localhost:{srv.port}" in (ARTIFACTS / "server.log").read_text()
