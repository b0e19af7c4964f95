"""Settings fail fast on bad values and pass the deploy checks with DEBUG off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env={**clean, **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


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
    result = manage("check", **{name: value, "ABPLAT_VAR": str(tmp_path)})
    assert result.returncode != 0
    # One line that names the variable, not a traceback that buries it.
    assert result.stderr.startswith("abplat: configuration error: ") and says in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_production_needs_a_secret_key(tmp_path):
    result = manage("check", ABPLAT_DEBUG="false", ABPLAT_VAR=str(tmp_path))
    assert result.returncode != 0 and "ABPLAT_SECRET_KEY is not set" in result.stderr


def test_check_deploy_passes_with_debug_off(tmp_path):
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING",
        ABPLAT_DEBUG="false", ABPLAT_SECRET_KEY="k" * 30 + "0123456789abcdefghijklmnop",
        ABPLAT_ALLOWED_HOSTS="abplat.example.com", ABPLAT_VAR=str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
