"""Settings fail fast on bad values and pass the deploy checks with DEBUG off.

Settings are a function of the environment (abplat.config.settings_from): every value and
combination is checked here in this process on a dict. One test starts manage.py to prove that a
bad value stops the process at start with one line naming it.
"""

from __future__ import annotations

import io
import os
import runpy
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from django.conf import global_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from abplat.config import settings_from

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_KEY = "k" * 30 + "0123456789abcdefghijklmnop"


def refusal(environ: Mapping[str, str]) -> str:
    """The message settings_from refuses ``environ`` with: one line (what manage.py prints)."""
    with pytest.raises(ImproperlyConfigured) as refused:
        settings_from(environ)
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    return message


def started_with(environ: Mapping[str, str]) -> override_settings:
    """This process's settings as a process started with ``environ`` has them: every setting
    that comes from the environment replaced, the others being the same module's. A setting this
    process's environment gave and ``environ`` does not (the TLS hardening exists with debug off
    only) is Django's default, as there. DATABASES stays: Django connects at start, and checks
    read no database without --database."""
    values = settings_from(environ)
    for name in set(settings_from(os.environ)) - set(values):
        values[name] = getattr(global_settings, name)
    values.pop("DATABASES")
    return override_settings(**values)


def deploy_check(environ: Mapping[str, str]) -> str:
    """``manage.py check --deploy --fail-level WARNING`` on ``environ``'s settings, in this
    process: its output, or SystemCheckError listing what failed."""
    out = io.StringIO()
    with started_with(environ):
        call_command("check", "--deploy", "--fail-level", "WARNING", stdout=out, stderr=out)
    return out.getvalue()


@pytest.mark.process
def test_a_bad_value_stops_the_process_at_start_with_one_line_naming_it(tmp_path):
    # A real manage.py: what a refused setting looks like to whoever started the process.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    environ.update(ABPLAT_DEBUG="maybe", ABPLAT_VAR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    # One line that names the variable, not a traceback that buries it.
    assert result.stderr.startswith("abplat: configuration error: Unexpected value ABPLAT_DEBUG='maybe'")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("ABPLAT_DEBUG", "maybe", "ABPLAT_DEBUG='maybe'"),
        ("ABPLAT_DATABASE_URL", "mysql://h/db", "ABPLAT_DATABASE_URL"),
        ("ABPLAT_BROKER_URL", "kafka://h", "ABPLAT_BROKER_URL"),
        ("ABPLAT_ETCD_ENDPOINTS", "h:notaport", "ABPLAT_ETCD_ENDPOINTS"),
        ("ABPLAT_CLICKHOUSE_URL", "http://h:8123", "ABPLAT_CLICKHOUSE_URL"),
        ("ABPLAT_ETCD_PREFIX", "abplat", "ABPLAT_ETCD_PREFIX"),
        ("ABPLAT_WORKER_CONCURRENCY", "0", "ABPLAT_WORKER_CONCURRENCY"),
        ("ABPLAT_VARIANT_CA_BUNDLE", "/nonexistent/ca.pem", "ABPLAT_VARIANT_CA_BUNDLE"),
        ("ABPLAT_CACHE_URL", "memcached://h:11211", "ABPLAT_CACHE_URL"),
        ("ABPLAT_CACHE_URL", "redis://h:6379/cache", "ABPLAT_CACHE_URL"),
        ("ABPLAT_CSRF_TRUSTED_ORIGINS", "abplat.example.com", "ABPLAT_CSRF_TRUSTED_ORIGINS item 'abplat"),
        ("ABPLAT_TRUSTED_PROXIES", "nginx.internal", "ABPLAT_TRUSTED_PROXIES item 'nginx.internal'"),
        ("ABPLAT_STATIC_STORAGE", "s3", "ABPLAT_STATIC_STORAGE='s3'"),
    ],
)
def test_bad_environment_value_stops_start_naming_the_variable(tmp_path, name, value, says):
    assert says in refusal({name: value, "ABPLAT_VAR": str(tmp_path)})


@pytest.mark.parametrize(
    "environ, says",
    [
        # Read with debug off only.
        (
            {"ABPLAT_SECRET_KEY": DEPLOY_KEY, "ABPLAT_SECURE_COOKIES": "maybe"},
            "ABPLAT_SECURE_COOKIES='maybe'",
        ),
        (
            {"ABPLAT_SECRET_KEY": DEPLOY_KEY, "ABPLAT_SSL_REDIRECT": "sometimes"},
            "ABPLAT_SSL_REDIRECT='sometimes'",
        ),
        ({"ABPLAT_SECRET_KEY": DEPLOY_KEY, "ABPLAT_HSTS_SECONDS": "-1"}, "ABPLAT_HSTS_SECONDS='-1'"),
        ({"ABPLAT_SECRET_KEY": "short-key"}, "ABPLAT_SECRET_KEY is too weak"),
        ({"ABPLAT_SECRET_KEY": "ab" * 40}, "ABPLAT_SECRET_KEY is too weak"),
        # Checks between values, and values checked beyond their type.
        (
            {
                "ABPLAT_DEBUG": "true",
                "ABPLAT_CLICKHOUSE_URL": "clickhouse://h/db",
                "ABPLAT_CLICKHOUSE_CLUSTER": "a-b",
            },
            "Unexpected value ABPLAT_CLICKHOUSE_CLUSTER='a-b'",
        ),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_CLICKHOUSE_CLUSTER": "main"},
            "ABPLAT_CLICKHOUSE_CLUSTER=main needs ABPLAT_CLICKHOUSE_URL",
        ),
        (
            {
                "ABPLAT_DEBUG": "true",
                "ABPLAT_REPLAY_WINDOW_S": "1000",
                "ABPLAT_TASK_SOFT_TIME_LIMIT_S": "1999",
            },
            "ABPLAT_REPLAY_WINDOW_S=1000 must be at most half of ABPLAT_TASK_SOFT_TIME_LIMIT_S=1999",
        ),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_LOG_LEVEL": "verbose"}, "ABPLAT_LOG_LEVEL='VERBOSE'"),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_LOG_FORMAT": "xml"}, "ABPLAT_LOG_FORMAT='xml'"),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_API_THROTTLE_ASSIGN": "5/fortnight"},
            "ABPLAT_API_THROTTLE_ASSIGN='5/fortnight'",
        ),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_OTEL_ENDPOINT": ""}, "ABPLAT_OTEL_ENDPOINT is empty"),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_OTEL_SERVICE_NAME": "x" * 256}, "ABPLAT_OTEL_SERVICE_NAME='xxx"),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_GATEWAY_AUTH": "open"}, "ABPLAT_GATEWAY_AUTH='open'"),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_ETCD_USER": "abplat", "ABPLAT_ETCD_PASSWORD": "pw"},
            "ABPLAT_ETCD_CA_CERT/CERT/KEY/USER/PASSWORD are set but ABPLAT_ETCD_ENDPOINTS is empty",
        ),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_ETCD_ENDPOINTS": "127.0.0.1:2379", "ABPLAT_ETCD_USER": "abplat"},
            "ABPLAT_ETCD_USER is set but ABPLAT_ETCD_PASSWORD is empty",
        ),
        # /metrics: who may read it, and the worker's own port.
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_METRICS_ALLOWED_CIDRS": "10.0.0.0/8,lan"},
            "Unexpected value ABPLAT_METRICS_ALLOWED_CIDRS item 'lan'",
        ),
        ({"ABPLAT_DEBUG": "true", "ABPLAT_METRICS_ALLOWED_CIDRS": "none"}, "nobody could read /metrics"),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_METRICS_TOKEN_FILE": "/nonexistent/token"},
            "Unexpected value ABPLAT_METRICS_TOKEN_FILE='/nonexistent/token': cannot read it",
        ),
        (
            {"ABPLAT_DEBUG": "true", "ABPLAT_WORKER_METRICS_PORT": "9108"},
            "ABPLAT_WORKER_METRICS_PORT=9108 needs ABPLAT_METRICS_DIR",
        ),
        # prometheus_client's variable is read from the mapping given too (the directory itself:
        # tests/telemetry/test_multiprocess.py).
        (
            {"ABPLAT_DEBUG": "true", "PROMETHEUS_MULTIPROC_DIR": "/run/metrics"},
            "PROMETHEUS_MULTIPROC_DIR='/run/metrics' is set but ABPLAT_METRICS_DIR is not",
        ),
    ],
)
def test_bad_combinations_stop_start_naming_the_variables(tmp_path, environ, says):
    assert says in refusal({**environ, "ABPLAT_VAR": str(tmp_path)})


def test_production_settings_load_without_a_key_for_the_processes_that_sign_nothing(tmp_path):
    # The web processes refuse to start without one: tests/foundation/test_secret_key.py.
    assert settings_from({"ABPLAT_DEBUG": "false", "ABPLAT_VAR": str(tmp_path)})["SECRET_KEY"] == ""


def test_check_deploy_passes_with_debug_off(tmp_path):
    output = deploy_check(
        {
            "ABPLAT_DEBUG": "false",
            "ABPLAT_SECRET_KEY": DEPLOY_KEY,
            "ABPLAT_ALLOWED_HOSTS": "abplat.example.com",
            "ABPLAT_VAR": str(tmp_path),
        }
    )
    assert "no issues" in output, output


def test_the_deploy_check_sees_the_environment_given_not_this_process(tmp_path):
    # This process runs with debug off but without the HTTPS redirect and secure cookies
    # (tests/plugin.py): what the check reports comes from the dict.
    with pytest.raises(SystemCheckError) as debug_on:
        deploy_check({"ABPLAT_DEBUG": "true", "ABPLAT_VAR": str(tmp_path)})
    # Debug on, and Django's defaults for what only debug off sets: no redirect, HSTS or secure cookies.
    for warning in ("security.W018", "security.W008", "security.W004", "security.W012"):
        assert warning in str(debug_on.value), warning
    environ = {"ABPLAT_SECRET_KEY": DEPLOY_KEY, "ABPLAT_SSL_REDIRECT": "false", "ABPLAT_VAR": str(tmp_path)}
    with pytest.raises(SystemCheckError, match="security.W008") as no_redirect:
        deploy_check(environ)
    assert "security.W012" not in str(no_redirect.value)  # cookies stay secure


def test_settings_read_only_the_mapping_given_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ABPLAT_DEBUG", "maybe")  # would stop a process; the dict decides here
    var = tmp_path / "not-made"
    values = settings_from(
        {"ABPLAT_DEBUG": "true", "ABPLAT_VAR": str(var), "ABPLAT_METRICS_DIR": str(var / "metrics")}
    )
    assert values["DEBUG"] is True and values["VAR_DIR"] == var
    assert values["DATABASES"]["default"]["NAME"] == var / "abplat.sqlite3"
    # The embedded database's backend makes the directory on its first connection
    # (tests/foundation/test_embedded_database.py), app start the metrics directory.
    assert values["DATABASES"]["default"]["ENGINE"] == "abplat.db.sqlite3"
    assert not var.exists()


def test_loading_the_settings_module_makes_nothing_on_disk(tmp_path, monkeypatch):
    # The module's code run afresh (runpy: this process's loaded settings stay as they are) on an
    # environment naming directories that do not exist.
    var = tmp_path / "not-made"
    monkeypatch.setenv("ABPLAT_VAR", str(var))
    monkeypatch.setenv("ABPLAT_METRICS_DIR", str(var / "metrics"))
    monkeypatch.delenv("ABPLAT_DATABASE_URL", raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    module = runpy.run_path(str(ROOT / "abplat" / "settings.py"))
    assert module["VAR_DIR"] == var and module["DATABASES"]["default"]["NAME"] == var / "abplat.sqlite3"
    assert not var.exists()


def test_every_variable_reaches_the_setting_built_from_it(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    values = settings_from(
        {
            "ABPLAT_VAR": str(tmp_path),
            "ABPLAT_SECRET_KEY": DEPLOY_KEY,
            "ABPLAT_DATABASE_URL": "postgres://abplat:pw@db.internal/abplat",
            "ABPLAT_BROKER_URL": "redis://mq.internal:6379/0",
            "ABPLAT_CACHE_URL": "redis://mq.internal:6379/1",
            "ABPLAT_CLICKHOUSE_URL": "clickhouse://ch.internal/abplat",
            "ABPLAT_CLICKHOUSE_CLUSTER": "main",
            "ABPLAT_METRICS_ALLOWED_CIDRS": "none",
            "ABPLAT_METRICS_TOKEN_FILE": str(token),
            "ABPLAT_TRUSTED_PROXIES": "10.0.0.1",
            "ABPLAT_LOG_FORMAT": "json",
            "ABPLAT_LOG_LEVEL": "debug",
            "ABPLAT_STATIC_STORAGE": "plain",
            "ABPLAT_SSL_REDIRECT": "false",
            "ABPLAT_SECURE_COOKIES": "no",
            "ABPLAT_HSTS_SECONDS": "5",
            "ABPLAT_API_MAX_PAGE_SIZE": "50",
            "ABPLAT_TASK_SOFT_TIME_LIMIT_S": "600",
        }
    )
    assert values["DEBUG"] is False and values["SECRET_KEY"] == DEPLOY_KEY
    assert values["DATABASES"]["default"]["HOST"] == "db.internal"
    assert values["CELERY_BROKER_URL"] == "redis://mq.internal:6379/0"
    assert values["CELERY_TASK_ALWAYS_EAGER"] is False
    assert values["CELERY_TASK_SOFT_TIME_LIMIT"] == 600 and values["CELERY_TASK_TIME_LIMIT"] == 700
    assert values["CACHES"]["default"]["LOCATION"] == "redis://mq.internal:6379/1"
    assert values["METRICS_NETWORKS"] == () and values["METRICS_TOKEN"] == "t" * 32
    assert [str(n) for n in values["TRUSTED_PROXY_NETWORKS"]] == ["10.0.0.1/32"]
    assert values["LOGGING"]["handlers"]["console"]["formatter"] == "json" and values["LOG_LEVEL"] == "DEBUG"
    assert values["STORAGES"]["staticfiles"]["BACKEND"].endswith(".StaticFilesStorage")
    assert values["REST_FRAMEWORK"]["PAGE_SIZE"] == 50
    assert values["SECURE_SSL_REDIRECT"] is False and values["SESSION_COOKIE_SECURE"] is False
    assert values["CSRF_COOKIE_SECURE"] is False and values["SECURE_HSTS_SECONDS"] == 5


def test_debug_on_has_a_development_key_and_no_tls_hardening(tmp_path):
    values = settings_from({"ABPLAT_DEBUG": "true", "ABPLAT_VAR": str(tmp_path)})
    assert values["SECRET_KEY"].startswith("django-insecure-")
    assert not {"SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE", "SECURE_HSTS_SECONDS"} & set(values)


def test_the_settings_module_holds_what_the_process_environment_gives():
    import abplat.settings as module

    values = settings_from(os.environ)
    values.pop("DATABASES")  # the test database's name is written into it once it is created
    assert {name: getattr(module, name, "missing") for name in values} == values
