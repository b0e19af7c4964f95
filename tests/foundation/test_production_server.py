"""The production web server as docs/deploy.md runs it: debug off, `collectstatic` into a fresh
STATIC_ROOT, gunicorn with gunicorn.conf.py on a free port, WhiteNoise serving the admin's and
the API docs' files (content-hashed names, cached for a year). Checked in headless Chromium:
the admin's CSS is applied and Swagger UI lists the API's operations."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.browser import ARTIFACTS, launch, watch_errors
from tests.workers.background import ROOT, manage

USER, PASSWORD = "ops", "pw-ops-production-server"
# Only the admin's base.css sets this: #header { background: var(--header-bg) } = #417690.
ADMIN_HEADER_BG = "rgb(65, 118, 144)"
YEAR_S = 365 * 24 * 3600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Production settings on plain loopback HTTP: debug off, a secret key, the manifest
    storage, a private ABPLAT_VAR and STATIC_ROOT; nothing else of the test session's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    return {
        **base,
        "ABPLAT_VAR": str(tmp / "var"),
        "ABPLAT_STATIC_ROOT": str(tmp / "static"),
        "ABPLAT_DEBUG": "false",
        "ABPLAT_SECRET_KEY": os.environ["ABPLAT_SECRET_KEY"],
        "ABPLAT_SSL_REDIRECT": "false",
        "ABPLAT_SECURE_COOKIES": "false",
        "ABPLAT_STATIC_STORAGE": "manifest",
        **extra,
    }


def _gunicorn(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"), "abplat.wsgi"],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, gunicorn log) of a production server over a migrated SQLite database with
    one staff user."""
    tmp = tmp_path_factory.mktemp("production")
    port = _free_port()
    env = _server_env(tmp, ABPLAT_WEB_BIND=f"127.0.0.1:{port}")
    manage(env, "migrate", "-v0")
    manage(env, "collectstatic", "--noinput", "-v0")
    manage(
        env,
        "shell",
        "-c",
        "from django.contrib.auth.models import User; "
        f"User.objects.create_superuser({USER!r}, 'ops@example.com', {PASSWORD!r})",
    )
    log = tmp / "gunicorn.log"
    proc = _gunicorn(env, log)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, log)
    yield url, log
    _stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"gunicorn did not answer /healthz on {url}:\n{log.read_text()}", pytrace=False)
        time.sleep(0.2)


def _far_future(response) -> bool:
    cache = response.headers.get("cache-control", "")
    ages = [int(p.split("=", 1)[1]) for p in cache.replace(" ", "").split(",") if p.startswith("max-age=")]
    return "immutable" in cache and bool(ages) and ages[0] >= YEAR_S


@pytest.mark.browser
def test_admin_css_and_swagger_ui_load_from_gunicorn_with_debug_off(server):
    from playwright.sync_api import sync_playwright

    url, log = server
    errors: list[str] = []
    static: dict[str, object] = {}
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme="light")
            watch_errors(page, errors)
            page.on("response", lambda r: static.__setitem__(r.url, r) if "/static/" in r.url else None)
            page.goto(f"{url}/admin/login/?next=/api/docs/")

            # the admin's CSS arrived under its content-hashed name, cacheable for a year, and applies
            base_css = [u for u in static if "/static/admin/css/base." in u and u.endswith(".css")]
            assert len(base_css) == 1, sorted(static)
            assert base_css[0].rsplit("/", 1)[1] != "base.css", "not the manifest's hashed name"
            css = static[base_css[0]]
            assert css.status == 200 and _far_future(css), (css.status, css.headers)
            header_bg = page.evaluate("getComputedStyle(document.getElementById('header')).backgroundColor")
            assert header_bg == ADMIN_HEADER_BG

            page.fill("#id_username", USER)
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url("**/api/docs/", timeout=60_000)
            # Swagger UI's bundle loaded from our static files and rendered the operations
            page.wait_for_selector(".opblock", state="visible", timeout=60_000)
            bundle = [u for u in static if "swagger-ui-bundle." in u and u.endswith(".js")]
            assert len(bundle) == 1, sorted(static)
            assert static[bundle[0]].status == 200 and _far_future(static[bundle[0]])
            assert page.evaluate("typeof window.SwaggerUIBundle") == "function"
            operations = page.locator(".opblock .opblock-summary-path").all_inner_texts()
            assert any("/api/experiments" in op for op in operations), operations
            assert page.locator(".opblock").count() >= 10
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "production-api-docs.png"))
        finally:
            browser.close()
    assert errors == [], f"browser errors: {errors}\n{log.read_text()[-3000:]}"
    # the requests went through gunicorn's access log (the configured format, duration in ms)
    assert '"GET /api/docs/ HTTP/1.1" 200' in log.read_text()


def test_unhashed_static_names_are_served_with_a_short_cache(server):
    """A file asked for by its plain name (a bookmark, a proxy's probe) is served too, but
    cached briefly: only content-hashed names may be kept for a year."""
    url, _ = server
    with urllib.request.urlopen(url + "/static/admin/css/base.css", timeout=10) as r:
        assert r.status == 200 and "max-age=60" in r.headers["Cache-Control"]
        assert "immutable" not in r.headers["Cache-Control"]


@pytest.mark.process
def test_several_workers_on_the_embedded_store_are_refused(tmp_path):
    """chDB opens in one process only: gunicorn stops at start naming the setting."""
    env = _server_env(tmp_path, ABPLAT_WEB_BIND=f"127.0.0.1:{_free_port()}", ABPLAT_WEB_WORKERS="3")
    result = subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"), "abplat.wsgi"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "3 web workers need a ClickHouse server (ABPLAT_CLICKHOUSE_URL)" in result.stderr


@pytest.mark.process
def test_a_bad_web_setting_stops_gunicorn_naming_it(tmp_path):
    env = _server_env(tmp_path, ABPLAT_WEB_THREADS="many")
    result = subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"), "abplat.wsgi"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "ABPLAT_WEB_THREADS='many': use a whole number" in result.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.process
def test_a_worker_that_exits_takes_its_live_gauges_with_it(tmp_path):
    """gunicorn.conf.py's child_exit hook (telemetry.metrics.gunicorn_child_exit): the live
    gauges of a killed worker leave ABPLAT_METRICS_DIR; its counters stay, so totals never drop."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    env = _server_env(tmp_path, ABPLAT_WEB_BIND=f"127.0.0.1:{_free_port()}", ABPLAT_METRICS_DIR=str(metrics))
    log = tmp_path / "gunicorn.log"
    proc = _gunicorn(env, log)
    try:
        deadline = time.monotonic() + 60
        while not (workers := _children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        worker = workers[0]
        gauge, counter = metrics / f"gauge_livesum_{worker}.db", metrics / f"counter_{worker}.db"
        for path in (gauge, counter):
            if not path.exists():  # the worker's own file, if it made one, is left as it is
                path.write_bytes(b"")
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while gauge.exists():
            assert time.monotonic() < deadline, f"live gauge of dead worker {worker} kept:\n{log.read_text()}"
            time.sleep(0.1)
        assert counter.exists()
        assert proc.poll() is None, "the master keeps running (and starts a new worker)"
    finally:
        _stop(proc)


@pytest.mark.process
def test_json_logs_cover_gunicorns_own_lines_and_the_access_log(tmp_path):
    """ABPLAT_LOG_FORMAT=json: every line the server writes is one JSON object, and an access
    line carries the request id the application logged under."""
    port = _free_port()
    env = _server_env(tmp_path, ABPLAT_WEB_BIND=f"127.0.0.1:{port}", ABPLAT_LOG_FORMAT="json")
    # collected static files, as in production (WhiteNoise warns about a missing STATIC_ROOT with a
    # Python warning, which is not a log record)
    (tmp_path / "static").mkdir()
    log = tmp_path / "gunicorn.log"
    proc = _gunicorn(env, log)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        probe = urllib.request.Request(
            f"http://127.0.0.1:{port}/healthz", headers={"X-Request-Id": "probe-7"}
        )
        with urllib.request.urlopen(probe, timeout=10) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "probe-7"
    finally:
        _stop(proc)
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    assert {"gunicorn.error", "gunicorn.access"} <= {r["logger"] for r in records}
    access = [r["message"] for r in records if r["logger"] == "gunicorn.access"]
    assert any('"GET /healthz HTTP/1.1" 200' in m and m.endswith(" probe-7") for m in access), access
