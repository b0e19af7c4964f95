"""manage.py gateway as its users run it: a child process on uvicorn with the real recorder,
against simulators; SIGTERM drains the streams in flight; bad settings stop it at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from experiments import services
from gateway.config import GatewayConfig
from samples.schema import SAMPLES_FROM
from tests.gateway.conftest import KEY
from tests.workers.background import wait_for

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Tell me a long story"}]


def database_url() -> str:
    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    return (
        f"postgresql://{s['USER']}:{s['PASSWORD']}@{s['HOST'] or 'localhost'}:{s['PORT'] or 5432}/{s['NAME']}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway_command(
    settings, tmp_path: Path, *args: str, **env_overrides: str
) -> tuple[subprocess.Popen, str]:
    """`manage.py gateway *args` in a child process on this test's database, sample store and
    etcd, the key file holding KEY, a 30 s drain; (the child, its URL) once /healthz answers."""
    keys = tmp_path / "keys"
    keys.write_text(f"acme {KEY}\n")
    port = free_port()
    env = {
        **os.environ,
        "ABPLAT_DEBUG": "true",
        "ABPLAT_VAR": str(tmp_path / "var"),
        "ABPLAT_DATABASE_URL": database_url(),
        "ABPLAT_CLICKHOUSE_URL": settings.CLICKHOUSE_URL,
        "ABPLAT_SPOOL_DIR": str(tmp_path / "spool"),
        "ABPLAT_ETCD_ENDPOINTS": ",".join(f"{h}:{p}" for h, p in settings.ETCD_ENDPOINTS),
        "ABPLAT_ETCD_PREFIX": settings.ETCD_PREFIX,
        "ABPLAT_GATEWAY_KEYS_FILE": str(keys),
        "ABPLAT_GATEWAY_DRAIN_S": "30",
        **env_overrides,
    }
    child = subprocess.Popen(
        [sys.executable, "manage.py", "gateway", "--port", str(port), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return child, url
        except httpx.HTTPError:
            pass
        if child.poll() is not None or time.monotonic() > deadline:
            out = child.stdout.read().decode() if child.poll() is not None else ""
            child.kill()
            pytest.fail(f"the gateway did not come up (exit {child.poll()}):\n{out}")
        time.sleep(0.1)


@pytest.fixture
def slow_sim():
    from simulator.serve import start_in_thread

    handle = start_in_thread("default", model="tiny-llama")  # ~15 ms a token: streams last seconds
    yield handle
    handle.stop()


@pytest.mark.services
@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
@pytest.mark.engine
def test_the_gateway_command_serves_records_and_drains_on_sigterm(
    transactional_db, etcd_weights, settings, sample_store, document, slow_sim, users, tmp_path
):
    from django.contrib.auth.models import User

    for v in document["variants"]:
        v["endpoint"], v["api"] = slow_sim.url + "/v1", "chat"
    actor = User.objects.get(username="pat")
    experiment = services.apply_document(document, actor=actor).experiment
    services.transition(experiment, "start", actor)
    child, url = start_gateway_command(settings, tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        reply = client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="u-1", max_tokens=4)
        assert reply.choices[0].message.content
        # A stream in flight when SIGTERM comes: it ends whole, then the process exits.
        stream = client.chat.completions.create(
            model="ttft-opt", messages=MESSAGES, user="u-2", max_tokens=150, stream=True
        )
        got: list[str] = []
        first = threading.Event()

        def read() -> None:
            for chunk in stream:
                got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        child.send_signal(signal.SIGTERM)
        reader.join(60)
        assert not reader.is_alive()
        assert len(got) >= 150  # every token arrived (plus the role event)
        # uvicorn shuts down cleanly (lifespan: the recorder drains), then re-raises SIGTERM
        assert child.wait(60) in (0, -signal.SIGTERM)
        # a person (or a script) is told when to send the first request, and where
        assert (
            f"gateway: serving {url}/v1 (OpenAI-compatible), 1 worker process(es)"
            in child.stdout.read().decode()
        )
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    [(n, live)] = sample_store.query(f"SELECT count(), countIf(mode = 'live') FROM {SAMPLES_FROM}")
    assert (n, live) == (2, 2)


@pytest.mark.services
@pytest.mark.engine
def test_with_web_one_process_serves_the_gateway_and_the_report_on_the_embedded_store(
    transactional_db, etcd_weights, settings, document, sims, users, tmp_path
):
    """On the embedded chDB (one process may open it) the report reads what the gateway records,
    because `manage.py gateway --with-web` is both: traffic on /v1, the web app on the rest."""
    from rest_framework.authtoken.models import Token

    for v in document["variants"]:
        v["endpoint"], v["api"] = sims[v["key"]].url + "/v1", "chat"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    token = Token.objects.create(user=users["analyst"]).key
    embedded = {"ABPLAT_CLICKHOUSE_URL": "", "ABPLAT_VAR": str(tmp_path / "var")}
    migrate = subprocess.run(
        [sys.executable, "manage.py", "clickhouse_migrate"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ABPLAT_DEBUG": "true", "ABPLAT_DATABASE_URL": database_url(), **embedded},
        timeout=120,
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    child, url = start_gateway_command(settings, tmp_path, "--with-web", **embedded)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for i in range(5):
            reply = client.chat.completions.with_raw_response.create(
                model="ttft-opt", messages=MESSAGES, user=f"u-{i}", max_tokens=4
            )
            assert reply.headers["x-abplat-variant"] in {"fp16", "awq", "awq-fa2"}
        assert httpx.get(url + "/admin/login/").status_code == 200  # Django, same port
        auth = {"Authorization": f"Token {token}"}
        seen = {}

        def reported_all() -> bool:  # the recorder writes in batches, off the request path
            report = httpx.get(url + "/api/experiments/ttft-opt/report?mode=live", headers=auth, timeout=30)
            assert report.status_code == 200, report.text
            seen["report"] = report.json()
            return sum(v["n"] for v in seen["report"]["variants"]) == 5

        wait_for(reported_all, timeout=30, poll=0.2, message=lambda: str(seen.get("report")))
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def test_with_web_routes_the_gateways_paths_to_it_and_the_rest_to_the_web_app():
    import asyncio

    from gateway.routing import parse_routes
    from gateway.with_web import GatewayAndWeb

    calls = []

    def app(name):
        async def call(scope, receive, send):
            calls.append((name, scope["type"], scope.get("path")))

        return call

    gateway = app("gateway")
    gateway.config = GatewayConfig(keys=None, routes=parse_routes(["/team-a=exp"]))
    both = GatewayAndWeb(gateway, app("web"))
    for scope in [
        {"type": "lifespan"},
        {"type": "http", "path": "/v1/chat/completions"},
        {"type": "http", "path": "/v1/models"},
        {"type": "http", "path": "/team-a/v1/completions"},
        {"type": "http", "path": "/healthz"},
        {"type": "http", "path": "/admin/"},
        {"type": "http", "path": "/v10/x"},
        {"type": "http", "path": "/team-a/admin"},
        {"type": "http", "path": "/api/experiments/"},
    ]:
        asyncio.run(both(scope, None, None))
    assert [name for name, *_ in calls] == [
        "gateway",
        "gateway",
        "gateway",
        "gateway",
        "web",
        "web",
        "web",
        "web",
        "web",
    ]


def test_bad_gateway_settings_stop_it_at_start_naming_the_setting(settings, tmp_path):
    settings.GATEWAY_AUTH, settings.GATEWAY_KEYS_FILE = "keys", ""
    with pytest.raises(ImproperlyConfigured, match="ABPLAT_GATEWAY_KEYS_FILE is not set"):
        GatewayConfig.from_settings()
    bad = tmp_path / "keys"
    bad.write_text("acme short\n")
    settings.GATEWAY_KEYS_FILE = str(bad)
    with pytest.raises(ImproperlyConfigured, match="ABPLAT_GATEWAY_KEYS_FILE line 1"):
        GatewayConfig.from_settings()
    settings.GATEWAY_KEYS_FILE = str(tmp_path / "missing")
    with pytest.raises(ImproperlyConfigured, match="cannot read it"):
        GatewayConfig.from_settings()
    settings.GATEWAY_AUTH = "none"
    for name, value, match in [
        ("GATEWAY_ROUTES", ["no-equals"], "ABPLAT_GATEWAY_ROUTES"),
        ("GATEWAY_ROUTES", ["/v1=exp"], "hides the gateway's own paths"),
        ("GATEWAY_ROUTES", ["m=not a key"], "not an experiment key"),
        ("GATEWAY_DEFAULT_EXPERIMENT", "bad key!", "ABPLAT_GATEWAY_DEFAULT_EXPERIMENT"),
        ("GATEWAY_RETRY_ON_CONTROL", ["a b"], "ABPLAT_GATEWAY_RETRY_ON_CONTROL"),
        ("GATEWAY_USER_HEADER", "authorization", "ABPLAT_GATEWAY_USER_HEADER"),
        ("GATEWAY_FORWARD_HEADERS", ["x-ok", "host"], "ABPLAT_GATEWAY_FORWARD_HEADERS"),
        ("GATEWAY_HEADERS_TIMEOUT_S", 10_000, "ABPLAT_GATEWAY_TOTAL_TIMEOUT_S"),
    ]:
        old = getattr(settings, name)
        setattr(settings, name, value)
        with pytest.raises(ImproperlyConfigured, match=match):
            GatewayConfig.from_settings()
        setattr(settings, name, old)
    assert GatewayConfig.from_settings().keys is None


@pytest.mark.process
def test_the_settings_parse_strictly():
    env = {**os.environ, "ABPLAT_DEBUG": "true", "ABPLAT_GATEWAY_USER_RATE": "fast"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='abplat.settings'; django.setup()",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "ABPLAT_GATEWAY_USER_RATE='fast'" in done.stderr
