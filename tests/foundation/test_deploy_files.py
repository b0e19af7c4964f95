"""The deployment files (docs/deploy.md, docs/deploy/, Procfile, gunicorn.conf.py) say what the
code does: every setting they name exists, and the example settings pass Django's deploy check
once the placeholder secret is replaced (and are refused with it)."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_FILES = [
    ROOT / "docs" / "deploy.md",
    ROOT / "Procfile",
    ROOT / "gunicorn.conf.py",
    *sorted((ROOT / "docs" / "deploy").iterdir()),
]
NAME = re.compile(r"\bABPLAT_[A-Z0-9_]*[A-Z0-9]\b")
SOURCE_DIRS = (
    "abplat",
    "dashboards",
    "workers",
    "traces",
    "serving",
    "simulator",
    "analysis",
    "replay",
    "experiments",
    "samples",
    "streaming",
    "stats",
    "telemetry",
    "rollouts",
    "capacity",
)


def _read_settings() -> set[str]:
    """Every ABPLAT_ name the code reads (as a string literal)."""
    found = set()
    for path in [ROOT / "gunicorn.conf.py", *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))]:
        found |= set(re.findall(r"""["'](ABPLAT_[A-Z0-9_]+)["']""", path.read_text()))
    return found


def _example_env() -> dict[str, str]:
    env = {}
    for line in (ROOT / "docs" / "deploy" / "abplat.env").read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep and NAME.fullmatch(name), f"abplat.env: not NAME=value: {line!r}"
            env[name] = value
    return env


def test_every_setting_the_deploy_files_name_is_read_by_the_code():
    read = _read_settings()
    named = {
        n for path in DEPLOY_FILES for n in NAME.findall(path.read_text()) if not n.startswith("ABPLAT_TEST_")
    }
    assert len(named) > 30  # the files really name the settings
    assert sorted(named - read) == []


def _check_deploy(tmp_path: Path, **override: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ABPLAT_ENV_FILE": ""}  # no .env: tests/plugin.py
    # the example's paths live under /var/lib/abplat: here under tmp_path
    where = {
        "ABPLAT_VAR": str(tmp_path),
        "ABPLAT_STATIC_ROOT": str(tmp_path / "static"),
        "ABPLAT_SPOOL_DIR": str(tmp_path / "spool"),
        "ABPLAT_METRICS_DIR": str(tmp_path / "metrics"),
    }
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={**base, **_example_env(), **where, **override},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process
def test_the_example_settings_pass_the_deploy_check(tmp_path):
    result = _check_deploy(tmp_path, ABPLAT_SECRET_KEY=secrets.token_urlsafe(50))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "System check identified no issues" in result.stdout


@pytest.mark.process
def test_the_example_placeholder_secret_is_refused(tmp_path):
    result = _check_deploy(tmp_path)
    assert result.returncode != 0
    assert "ABPLAT_SECRET_KEY is too weak" in result.stderr


@pytest.mark.parametrize("unit", ["abplat-web.service", "abplat-worker.service", "abplat-beat.service"])
def test_the_units_run_what_the_procfile_runs(unit):
    """One command per process, the same in the systemd unit and the Procfile."""
    procfile = dict(
        line.split(": ", 1)
        for line in (ROOT / "Procfile").read_text().splitlines()
        if line and line[0] != "#"
    )
    assert set(procfile) == {"web", "worker", "beat"}
    start = next(
        line.split("=", 1)[1]
        for line in (ROOT / "docs" / "deploy" / unit).read_text().splitlines()
        if line.startswith("ExecStart=")
    )
    process = unit.removeprefix("abplat-").removesuffix(".service")
    command = procfile[process].split(" --schedule ")[0]  # the schedule file: the state directory
    assert start.removeprefix("/opt/abplat/.venv/bin/").startswith(command)
