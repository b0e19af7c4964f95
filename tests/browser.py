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
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


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
