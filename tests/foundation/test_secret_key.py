"""The secret key is needed where something signs with it, not by every process: with debug off
and no ABPLAT_SECRET_KEY, commands (help, the simulator, checks) start; the web processes
(gunicorn, runserver, the gateway's --with-web) refuse to, in one line, and Django's signing
refuses an empty key (abplat/config.py, require_secret_key)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from abplat.config import SECRET_KEY_MISSING, require_secret_key, settings_from
from tests.cli import as_typed
from tests.foundation.test_settings import deploy_check

ROOT = Path(__file__).resolve().parents[2]
REFUSED = f"abplat: configuration error: {SECRET_KEY_MISSING}"


def no_key(tmp_path: Path) -> dict:
    """A process environment with debug off and no secret key (nor any env file)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    return base | {"ABPLAT_ENV_FILE": "", "ABPLAT_VAR": str(tmp_path)}


def run(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_settings_load_without_a_key_and_leave_it_empty(tmp_path):
    values = settings_from({"ABPLAT_VAR": str(tmp_path)})
    assert values["DEBUG"] is False and values["SECRET_KEY"] == ""
    assert values["SECURE_SSL_REDIRECT"] is True  # production's hardening all the same


def test_what_signs_refuses_an_empty_key():
    # (A context, not pytest-django's settings fixture: its teardown would read the empty key.)
    with override_settings(SECRET_KEY=""):
        with pytest.raises(ImproperlyConfigured):
            signing.dumps({"user": 1})
        with pytest.raises(ImproperlyConfigured) as refused:
            require_secret_key()
    assert str(refused.value) == SECRET_KEY_MISSING and "\n" not in SECRET_KEY_MISSING
    require_secret_key()  # this session's key: nothing to say


def test_the_deploy_check_flags_a_missing_key(tmp_path):
    with pytest.raises(Exception, match="security.W009"):
        deploy_check({"ABPLAT_VAR": str(tmp_path), "ABPLAT_ALLOWED_HOSTS": "abplat.example.com"})


def test_the_gateway_serving_the_web_app_refuses_without_a_key():
    with override_settings(SECRET_KEY="", GATEWAY_AUTH="none"):
        code, _, err = as_typed("gateway", "--port", "0", "--with-web")
    assert code == 1
    assert err.strip().splitlines() == [
        "abplat: --with-web: ABPLAT_SECRET_KEY is not set: the web app signs sessions and forms with it "
        "(at least 50 random characters) when ABPLAT_DEBUG is off; for development set ABPLAT_DEBUG=true "
        "(`make dev-env` writes it to .env)"
    ]


@pytest.mark.process
def test_help_and_checks_start_without_a_key(tmp_path):
    env = no_key(tmp_path)
    for argv in (
        ["--help"],
        ["simulator", "--help"],
        ["sla_report", "--help"],
        ["runserver", "--help"],
        ["check"],
    ):
        result = run(env, sys.executable, "manage.py", *argv)
        assert result.returncode == 0, (argv, result.stderr)
        assert "SECRET_KEY" not in result.stderr
    assert "--serve NAME=PORT" in run(env, sys.executable, "manage.py", "simulator", "--help").stdout


@pytest.mark.process
def test_the_simulator_serves_without_a_key(tmp_path):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "simulator", "--port", str(port)],
        cwd=ROOT,
        env=no_key(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()  # printed once it listens (simulator/serve.py)
        assert first.startswith("simulator profile=") and f"127.0.0.1:{port}" in first, (
            first + proc.stderr.read() if proc.poll() is not None else first
        )
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.process
@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"), "abplat.wsgi"],
        [sys.executable, "manage.py", "runserver", "127.0.0.1:0", "--noreload"],
    ],
    ids=["gunicorn", "runserver"],
)
def test_a_web_process_with_debug_off_and_no_key_refuses_to_start_in_one_line(tmp_path, argv):
    result = run(no_key(tmp_path), *argv)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [REFUSED]


@pytest.mark.process
def test_the_wsgi_application_refuses_to_load_without_a_key(tmp_path):
    # Any WSGI server (not only gunicorn.conf.py's check) meets the refusal when it loads the app.
    result = run(no_key(tmp_path), sys.executable, "-c", "import abplat.wsgi")
    assert result.returncode != 0 and result.stderr.strip().endswith(
        f"ImproperlyConfigured: {SECRET_KEY_MISSING}"
    )


def test_the_demo_that_serves_the_admin_refuses_before_its_replay_without_a_key(db):
    with override_settings(SECRET_KEY=""):
        code, out, err = as_typed("demo")
    assert code == 1 and out == ""  # nothing migrated, replayed or printed first
    assert err.strip().splitlines() == [
        "abplat: manage.py demo: ABPLAT_SECRET_KEY is not set: the web app signs sessions and forms with "
        "it (at least 50 random characters) when ABPLAT_DEBUG is off; for development set "
        "ABPLAT_DEBUG=true (`make dev-env` writes it to .env), or pass --no-serve"
    ]
