"""Headless Chromium for the browser tests (marker `browser`), driven by playwright.

The browser is the machine's Chromium: ABPLAT_TEST_CHROMIUM when set, else `chromium` (or
`chromium-browser`) on PATH. A missing one fails the test with what to install or set, never
a skip (scripts/doctor.sh checks the same).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_ENV = "ABPLAT_TEST_CHROMIUM"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str:
    """The Chromium executable, or a failed test naming what is missing."""
    given = os.environ.get(CHROMIUM_ENV, "").strip()
    path = given or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        where = f"{CHROMIUM_ENV}={given!r} is not an executable file" if given else "no chromium on PATH"
        pytest.fail(
            f"headless Chromium missing ({where}): install Debian's chromium (make browser, as root) "
            f"or set {CHROMIUM_ENV} to a Chromium executable",
            pytrace=False,
        )
    return path


def launch(playwright):
    """A headless Chromium browser (close it in the test's finally)."""
    return playwright.chromium.launch(executable_path=chromium_path(), args=ARGS)


def watch_errors(page, errors: list[str]) -> None:
    """Console errors, page errors and HTTP responses >= 400 of ``page`` go to ``errors``; the
    Chromium /favicon.ico probe gets an empty answer (pages without an icon link would 404)."""
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
    page.route("**/favicon.ico", lambda route: route.fulfill(status=204, body=""))


# The layout check every page test runs: text that overlaps other text, text cut off by its
# container (an element with overflow other than visible, an <svg>, or the page's own width), and
# charts (elements with data-chart) that drew nothing and say nothing. Boxes are the rendered ones
# (getClientRects of text ranges, getBBox-equivalent client rects of SVG text), so a rotated axis
# title is measured where it is drawn.
_LAYOUT_JS = r"""
() => {
  const problems = [];
  const visible = el => {
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      const s = getComputedStyle(e);
      if (s.display === 'none' || s.visibility === 'hidden' || parseFloat(s.opacity) === 0) return false;
      // text for screen readers only (the admin's .visually-hidden): clipped to nothing on purpose
      if (s.clip === 'rect(0px, 0px, 0px, 0px)' && s.position === 'absolute') return false;
      // an icon's label moved out of its box on purpose (image replacement: the admin's
      // "Choose selected" arrows), hidden by its own overflow
      if (parseFloat(s.textIndent) <= -999 && s.overflow === 'hidden') return false;
      if (e.tagName === 'DETAILS' && !e.open && e !== el && !el.closest('summary')) return false;
    }
    return true;
  };
  const label = el => {
    const t = (el.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 50);
    const id = el.closest('[id]');
    return `"${t}"` + (id ? ` in #${id.id}` : '');
  };
  // Text boxes: each HTML element's own text (its text-node children), each SVG <text>.
  const items = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.textContent.trim()) continue;
    const el = n.parentElement;
    if (!el || ['SCRIPT', 'STYLE', 'TEXTAREA', 'OPTION', 'TITLE'].includes(el.tagName)) continue;
    if (el.closest('svg')) {
      const t = el.closest('text');
      if (!t || seen.has(t)) continue;
      seen.add(t);
      if (!visible(t)) continue;
      const r = t.getBoundingClientRect();
      if (r.width > 0 && r.height > 0) items.push({el: t, r, svg: t.ownerSVGElement});
      continue;
    }
    if (!visible(el)) continue;
    const range = document.createRange();
    range.selectNodeContents(n);
    for (const r of range.getClientRects()) {
      if (r.width > 0.5 && r.height > 0.5) items.push({el, r, svg: null});
    }
  }
  const sx = window.scrollX, sy = window.scrollY;
  const inter = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1 &&
                          Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
  for (let i = 0; i < items.length; i++) {
    for (let j = i + 1; j < items.length; j++) {
      const a = items[i], b = items[j];
      if (a.el === b.el || a.el.contains(b.el) || b.el.contains(a.el)) continue;
      if (inter(a.r, b.r)) problems.push(`overlap: ${label(a.el)} and ${label(b.el)}`);
    }
  }
  const pageWidth = document.documentElement.clientWidth;
  for (const it of items) {
    const r = it.r;
    if (r.right + sx > document.documentElement.scrollWidth + 0.5 || r.left + sx < -0.5 || r.right > pageWidth + 0.5) {
      problems.push(`clipped by the page: ${label(it.el)}`);
      continue;
    }
    let box = null;
    if (it.svg) {
      // the outermost svg of the chart: plotly draws titles in a layer svg above the plot's
      let svg = it.svg;
      while (svg.parentElement && svg.parentElement.closest('svg')) svg = svg.parentElement.closest('svg');
      box = svg.getBoundingClientRect();
      if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 || r.bottom > box.bottom + 1)
        problems.push(`clipped by its chart: ${label(it.el)}`);
      continue;
    }
    for (let e = it.el.parentElement; e && e !== document.body; e = e.parentElement) {
      const s = getComputedStyle(e);
      if (s.overflowX !== 'visible' || s.overflowY !== 'visible') {
        const c = e.getBoundingClientRect();
        if (r.left < c.left - 1 || r.right > c.right + 1 || r.top < c.top - 1 || r.bottom > c.bottom + 1)
          problems.push(`clipped by its container: ${label(it.el)}`);
        break;
      }
    }
  }
  for (const chart of document.querySelectorAll('[data-chart]')) {
    if (!visible(chart)) continue;
    const drawn = (chart.data || []).length > 0 && chart.querySelector('.main-svg');
    const said = (chart.querySelector('.empty-chart') || {}).textContent;
    if (!drawn && !(said && said.trim())) problems.push(`chart ${chart.dataset.chart}: no data and no sentence saying why`);
  }
  return problems;
}
"""


def layout_problems(page) -> list[str]:
    """What a reader of ``page`` would trip on: overlapping text, clipped text, charts with no data
    and no sentence. An empty list is a page that reads cleanly (at the page's current viewport)."""
    return page.evaluate(_LAYOUT_JS)


# Every chart drawn (its plotly div has an svg) or holding its sentence; then every drawn chart
# as wide as its card again after a resize (plotly redraws on the window's resize event).
SETTLED = """() => [...document.querySelectorAll('[data-chart]')].every(c =>
    c.querySelector('.empty-chart') || (c.querySelector('.main-svg') &&
    Math.abs(c.querySelector('.main-svg').getBoundingClientRect().width - c.getBoundingClientRect().width) < 2))"""
WIDE, NARROW = 1400, 1000


def log_in(page, base: str, username: str, next_url: str) -> None:
    """Sign in through the admin's login form as ``username`` (tests/conftest.py ``users``: its
    password is pw-<username>) and land on ``next_url``."""
    page.goto(f"{base}/admin/login/?next={next_url}")
    page.fill("#id_username", username)
    page.fill("#id_password", f"pw-{username}")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{next_url}", timeout=60_000)


def at_widths(page, widths: tuple[int, ...] = (WIDE, NARROW)) -> dict[int, list[str]]:
    """layout_problems at each of ``widths`` once the charts have redrawn; back to the first."""
    found = {}
    for width in widths:
        page.set_viewport_size({"width": width, "height": 1000})
        page.wait_for_function(SETTLED, timeout=30_000)
        found[width] = layout_problems(page)
    page.set_viewport_size({"width": widths[0], "height": 1000})
    return found
