"""Driving the served dashboard in a real browser (Playwright + Debian's Chromium): used by the
browser test (tests/test_dashboard_browser.py) and the benchmark (sparsecal.bench.dashboard).

- ``DashboardServer``: ``sparsecal dashboard RUN... --port P`` as a subprocess on a free local
  port, up once /_stcore/health answers; stopped (SIGINT, then kill) on exit.
- ``chromium(playwright)``: /usr/bin/chromium headless with the flags a machine without network
  needs (no background networking, component updates, sync or QUIC).
- ``visit(page, title)``: click the page in the sidebar navigation and wait until it is idle.
- ``change(page, action)``: change one control like a user and return the seconds until the page
  is interactive again: the script run the change triggers has finished (stApp's
  data-test-script-state went to "running" and back to "notRunning"), no element is stale, every
  plotly chart has drawn, and two animation frames have passed. Times are taken in the page
  (performance.now()), from just before the input event to that point.
- ``page_report(page)``: plotly charts drawn, exceptions and error alerts on the page.

Actions per page (PAGE_ACTIONS): ("select", label) picks another option of the selectbox with
that label; ("toggle", label) removes the last chosen value of a multiselect, or, when none is
left, chooses its first option (so repeated actions alternate).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ("Overview", "Density", "BLASST", "Stabilization", "Tiles", "Accuracy-speedup", "Export")
PAGE_ACTIONS = {
    "Overview": ("toggle", "Tasks"),
    "Density": ("select", "k"),
    "BLASST": ("select", "Target sparsity"),
    "Stabilization": ("select", "Length"),
    "Tiles": ("select", "Layer"),
    "Accuracy-speedup": ("toggle", "Methods"),
    "Export": ("select", "Layer"),
}
ERRORS = '[data-testid="stException"], [data-testid="stAlertContentError"]'

_WATCH = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  window.__scStates = [];
  if (window.__scObserver) window.__scObserver.disconnect();
  window.__scObserver = new MutationObserver(() => window.__scStates.push(
      [app.getAttribute('data-test-script-state'), performance.now()]));
  window.__scObserver.observe(app, {attributes: true, attributeFilter: ['data-test-script-state']});
  return performance.now();
}"""
_IDLE = """(needRun) => {
  const app = document.querySelector('[data-testid="stApp"]');
  if (!app || app.getAttribute('data-test-script-state') !== 'notRunning') return false;
  if (needRun && !(window.__scStates || []).some(s => s[0] === 'running')) return false;
  if (document.querySelector('[data-stale="true"]')) return false;
  const charts = document.querySelectorAll('[data-testid="stPlotlyChart"]');
  for (const c of charts) if (!c.querySelector('.main-svg')) return false;
  return true;
}"""
_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(performance.now()))))"


def sparsecal_command() -> list[str]:
    exe = Path(sys.executable).with_name("sparsecal")
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from sparsecal.cli import app; app()"]


class DashboardServer:
    """``sparsecal dashboard`` on a free local port, as a context manager (``.url``, ``.log``)."""

    def __init__(self, runs, results=(), log_path: Path | None = None, timeout: float = 90.0):
        from sparsecal.dashboard.serve import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = sparsecal_command() + ["dashboard", *map(str, runs), "--port", str(self.port)]
        for r in results:
            self.cmd += ["--results", str(r)]
        self.log_path, self.timeout, self.proc = log_path, timeout, None

    def __enter__(self) -> "DashboardServer":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        env = {k: v for k, v in os.environ.items() if k not in ("SPARSECAL_RUNS", "SPARSECAL_RESULTS")}
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.cmd)}` exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise TimeoutError(f"the dashboard did not answer on {self.url} within {self.timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def have_chromium() -> bool:
    return os.path.exists(CHROMIUM) or shutil.which("chromium") is not None


def chromium(playwright):
    """Debian's headless Chromium through Playwright (never a downloaded browser)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def wait_idle(page, need_run: bool, timeout_s: float = 60.0) -> float:
    """Wait until the app is interactive (see the module docstring); returns performance.now().

    With ``need_run``, a rerun must have been seen first; if none shows within a third of the time
    (a loaded machine can finish a rerun between two observer callbacks, or a click can land on
    the page already shown), an app that is idle, has nothing stale and has drawn every chart is
    accepted: a script still running or an undrawn chart still times out."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    if need_run:
        try:
            page.wait_for_function(_IDLE, arg=True, polling="raf", timeout=timeout_s * 1000 / 3)
            return page.evaluate(_FRAMES)
        except PlaywrightTimeout:
            timeout_s = timeout_s * 2 / 3
    page.wait_for_function(_IDLE, arg=False, polling="raf", timeout=timeout_s * 1000)
    return page.evaluate(_FRAMES)


def open_app(page, url: str, timeout_s: float = 90.0) -> None:
    page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
    page.wait_for_selector('[data-testid="stSidebarNav"]', timeout=timeout_s * 1000)
    wait_idle(page, False, timeout_s)


def visit(page, title: str, timeout_s: float = 60.0) -> float:
    """Go to a page through the sidebar navigation; returns the seconds until it is interactive."""
    t0 = page.evaluate(_WATCH)
    page.locator('[data-testid="stSidebarNavLink"]', has_text=title).first.click()
    return (wait_idle(page, True, timeout_s) - t0) / 1000.0


def _widget(page, testid: str, label: str):
    """The widget of this kind whose label is exactly ``label``."""
    name = page.locator('[data-testid="stWidgetLabel"]', has_text=re.compile(f"^{re.escape(label)}$"))
    return page.locator(f'[data-testid="{testid}"]').filter(has=name).first


def _select_other(page, label: str):
    """Open the selectbox labelled ``label``; returns its first option that is not selected."""
    box = _widget(page, "stSelectbox", label)
    box.locator('[role="combobox"]').first.click()
    options = page.locator('[role="listbox"] [role="option"]')
    options.first.wait_for(timeout=10_000)
    other = page.locator('[role="listbox"] [role="option"][aria-selected="false"]')
    if not other.count():
        raise AssertionError(f"selectbox {label!r} has no other option than {options.all_inner_texts()}")
    return other.first


def has_control(page, action) -> bool:
    """Whether the page shows the widget an action changes (Tiles has none without raw tiles)."""
    kind, label = action
    return _widget(page, "stSelectbox" if kind == "select" else "stMultiSelect", label).count() > 0


def change(page, action, timeout_s: float = 60.0) -> float:
    """Perform one PAGE_ACTIONS action; returns seconds until the page is interactive again."""
    kind, label = action
    if kind == "select":
        target = _select_other(page, label)
        t0 = page.evaluate(_WATCH)
        target.click()
    elif kind == "toggle":
        box = _widget(page, "stMultiSelect", label)
        box.locator('[role="combobox"]').first.click()
        if box.locator('.react-aria-ComboBox [data-tag]').count():
            t0 = page.evaluate(_WATCH)
            page.keyboard.press("Backspace")
        else:
            option = page.locator('[role="listbox"] [role="option"]').filter(has_not_text="Select all").first
            option.wait_for(timeout=10_000)
            t0 = page.evaluate(_WATCH)
            option.click()
    else:
        raise ValueError(f"unknown action {kind!r}")
    took = (wait_idle(page, True, timeout_s) - t0) / 1000.0
    page.keyboard.press("Escape")
    return took


def page_report(page) -> dict:
    """What the page shows: plotly charts drawn, error elements (exceptions, error alerts) with text."""
    drawn = page.evaluate("""() => [...document.querySelectorAll('[data-testid="stPlotlyChart"]')]
        .filter(c => c.querySelector('.main-svg')).length""")
    return {"charts": drawn, "chart_blocks": page.locator('[data-testid="stPlotlyChart"]').count(),
            "errors": page.locator(ERRORS).all_inner_texts(),
            "infos": page.locator('[data-testid="stAlertContentInfo"]').all_inner_texts()}
