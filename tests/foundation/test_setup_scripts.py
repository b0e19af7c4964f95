"""`make test` on a machine other than this one: services given by URL are used (never started
or skipped), and whatever is missing fails with its name and how to provide it
(scripts/doctor.sh, scripts/services.sh, scripts/clickhouse.sh, scripts/vllm_cpu.sh)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from samples.backends.clickhouse import ClickHouseServerBackend
from tests.plugin import SERVER_URL, server_url_for

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )


def _doctor(
    *args: str, python: tuple[str, ...] = (sys.executable,), **env: str
) -> subprocess.CompletedProcess:
    return _run([*python, "scripts/doctor.py", *args], **env)


def _lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """{check label: its line} of the doctor's report."""
    out = {}
    for line in result.stdout.splitlines():
        _, _, rest = line.partition("  ")
        label = rest.strip().split("  ")[0]
        out[label] = line
    return out


def _bogus(port: int) -> dict[str, str]:
    return {
        "TEST_POSTGRES_URL": f"postgres://abplat:s3cret@127.0.0.1:{port}/abplat",
        "ABPLAT_TEST_REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "ABPLAT_TEST_ETCD_ENDPOINTS": f"127.0.0.1:{port}",
        "ABPLAT_TEST_CLICKHOUSE_URL": f"clickhouse://default:@127.0.0.1:{port}/abplat_test",
        "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS": f"clickhouse://default:@127.0.0.1:{port}/a,clickhouse://default:@127.0.0.1:{port}/b",
    }


@pytest.mark.parametrize(
    "python", [(sys.executable,), (sys.executable, "-S")], ids=["venv-clients", "tcp-only"]
)
@pytest.mark.process
def test_the_doctor_names_every_service_that_does_not_answer_and_its_variable(python):
    """With the project's clients (real protocols) and without them (-S: no site-packages,
    as before `make venv`): each service is MISSING with its variable, its URL (no password)
    and what to do."""
    port = _closed_port()
    result = _doctor("--only", "services", python=python, **_bogus(port))
    assert result.returncode == 1
    lines = _lines(result)
    for label, var in [
        ("postgresql", "TEST_POSTGRES_URL"),
        ("redis", "ABPLAT_TEST_REDIS_URL"),
        ("etcd", "ABPLAT_TEST_ETCD_ENDPOINTS"),
        ("clickhouse", "ABPLAT_TEST_CLICKHOUSE_URL"),
        ("clickhouse cluster", "ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS"),
    ]:
        line = lines[label]
        assert line.startswith("MISSING"), line
        assert f"127.0.0.1:{port}" in line and var in line, line
        assert "or set" in line, line  # how to provide it
    assert "s3cret" not in result.stdout and "abplat:***@" in lines["postgresql"]
    assert "5 prerequisite(s) missing" in result.stderr


@pytest.mark.services
def test_the_doctor_passes_on_the_services_the_suite_uses():
    result = _doctor("--only", "services")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _lines(result)
    assert set(lines) == {"postgresql", "redis", "etcd", "clickhouse", "clickhouse cluster"}
    assert all(line.startswith("ok") for line in lines.values())


@pytest.mark.services
def test_a_missing_clickhouse_test_database_is_named_then_created_when_asked():
    database = f"abplat_doctor_{uuid.uuid4().hex[:8]}"
    url = server_url_for(database, SERVER_URL)
    missing = _doctor("--only", "services", ABPLAT_TEST_CLICKHOUSE_URL=url)
    assert missing.returncode == 1
    assert f"has no database {database!r} (ABPLAT_TEST_CLICKHOUSE_URL)" in _lines(missing)["clickhouse"]
    try:
        created = _doctor("--only", "services", "--create-databases", ABPLAT_TEST_CLICKHOUSE_URL=url)
        assert created.returncode == 0, created.stdout
        assert f"database {database}" in _lines(created)["clickhouse"]
    finally:
        ClickHouseServerBackend(SERVER_URL).execute(f"DROP DATABASE IF EXISTS {database}")


@pytest.mark.process
def test_the_doctor_names_a_chromium_that_is_not_there(tmp_path):
    result = _doctor("--only", "tools", ABPLAT_TEST_CHROMIUM=str(tmp_path / "chromium"))
    assert result.returncode == 1
    line = _lines(result)["chromium"]
    assert line.startswith("MISSING") and f"ABPLAT_TEST_CHROMIUM='{tmp_path / 'chromium'}'" in line


@pytest.mark.process
def test_the_doctor_names_a_python_older_than_the_project_needs(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9\n")
    fake.chmod(0o755)
    result = _doctor("--only", "tools", PYTHON=str(fake))
    line = _lines(result)["python"]
    assert result.returncode == 1 and line.startswith("MISSING")
    assert "Python 3.9: abplat needs 3.11 or later" in line and "PYTHON=" in line


@pytest.mark.services
def test_services_given_by_url_are_checked_not_started(tmp_path):
    """A Redis elsewhere that does not answer: services.sh starts nothing for it (no
    redis-server on a remote address) and fails naming it; the services that answer pass."""
    port = _closed_port()
    remote = f"redis://192.0.2.1:{port}/0"  # TEST-NET-1: never answers
    result = _run(["bash", "scripts/services.sh", "start"], ABPLAT_TEST_REDIS_URL=remote)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "starting it" not in result.stdout + result.stderr
    lines = _lines(result)
    assert lines["redis"].startswith("MISSING") and f"192.0.2.1:{port}" in lines["redis"]
    assert all(lines[k].startswith("ok") for k in ("postgresql", "etcd", "clickhouse")), result.stdout


def _path_without_apt_get(tmp_path: Path) -> str:
    """A PATH with the commands the scripts use and no apt-get (a machine it cannot install on)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("id", "dirname", "mkdir", "cat", "rm", "sleep", "seq", "tail", "grep", "env"):
        found = subprocess.run(
            ["bash", "-c", f"command -v {tool}"], capture_output=True, text=True
        ).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.process
def test_clickhouse_script_fails_clearly_where_it_cannot_install(tmp_path):
    result = _run(
        ["/bin/bash", "scripts/clickhouse.sh", "start"],
        PATH=_path_without_apt_get(tmp_path),
        ABPLAT_VAR=str(tmp_path / "var"),
        ABPLAT_CLICKHOUSE_SERVER=str(tmp_path / "no-clickhouse-server"),
    )
    assert result.returncode == 1
    assert "clickhouse-server is not installed" in result.stderr
    assert "apt-get install clickhouse-server clickhouse-client" in result.stderr
    assert "ABPLAT_TEST_CLICKHOUSE_URL" in result.stderr


@pytest.mark.process
def test_vllm_script_fails_clearly_without_its_python(tmp_path):
    result = _run(
        ["bash", "scripts/vllm_cpu.sh"],
        ABPLAT_VLLM_VENV=str(tmp_path / "vllm"),
        ABPLAT_VLLM_PYTHON="python3.11-not-here",
    )
    assert result.returncode == 1
    assert "python3.11-not-here not found" in result.stderr and "ABPLAT_VLLM_PYTHON" in result.stderr
    assert not (tmp_path / "vllm").exists()
