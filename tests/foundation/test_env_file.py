"""The development settings file: `make dev-env` writes .env once; manage.py, the Celery app and
gunicorn.conf.py read it under the environment (abplat/env.py); a bad line stops the process
with one line naming the file and the line; the test suite reads none (tests/plugin.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from abplat.env import DEFAULT_ENV_FILE, EnvError, load_env_file, parse_env_file
from tests.foundation.test_settings import DEPLOY_KEY

ROOT = Path(__file__).resolve().parents[2]


def test_lines_are_names_and_values_comments_and_quotes():
    text = (
        "# what this file is\n\nABPLAT_DEBUG=true\n  ABPLAT_LOG_LEVEL = WARNING \nA='x # y'\nB=\"\"\nC=a=b\n"
    )
    assert parse_env_file(text, ".env") == {
        "ABPLAT_DEBUG": "true",
        "ABPLAT_LOG_LEVEL": "WARNING",
        "A": "x # y",
        "B": "",
        "C": "a=b",
    }


@pytest.mark.parametrize(
    "line, says",
    [
        ("ABPLAT_DEBUG true", ".env, line 2: not NAME=value (a comment line starts with #)"),
        ("export ABPLAT_DEBUG=true", ".env, line 2: 'export ABPLAT_DEBUG' is not a variable name"),
        ("1ABPLAT=x", ".env, line 2: '1ABPLAT' is not a variable name"),
        ("ABPLAT_Y='secret", ".env, line 2: ABPLAT_Y's value opens a quote it does not close"),
        ("ABPLAT_DEBUG=true # dev", ".env, line 2: ABPLAT_DEBUG's value holds ' #'"),
        ("ABPLAT_X=1", ".env, line 2: ABPLAT_X is set twice (also on line 1)"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_and_the_line(line, says):
    with pytest.raises(EnvError) as bad:
        parse_env_file(f"ABPLAT_X=0\n{line}\n", ".env")
    assert str(bad.value).startswith(says) and "\n" not in str(bad.value)
    assert "secret" not in str(bad.value)  # a value is never repeated: it may be a password


def test_the_environment_wins_over_the_file_and_an_empty_name_reads_none(tmp_path):
    path = tmp_path / "dev.env"
    path.write_text("ABPLAT_DEBUG=true\nABPLAT_LOG_LEVEL=WARNING\n")
    environ = {"ABPLAT_ENV_FILE": str(path), "ABPLAT_LOG_LEVEL": "ERROR"}
    assert load_env_file(environ) == path
    assert environ == {"ABPLAT_ENV_FILE": str(path), "ABPLAT_LOG_LEVEL": "ERROR", "ABPLAT_DEBUG": "true"}
    environ = {"ABPLAT_ENV_FILE": ""}
    assert load_env_file(environ, default=path) is None and environ == {"ABPLAT_ENV_FILE": ""}


def test_the_default_file_is_beside_manage_py_and_may_be_absent(tmp_path):
    assert DEFAULT_ENV_FILE == ROOT / ".env"
    environ: dict[str, str] = {}
    assert load_env_file(environ, default=tmp_path / ".env") is None and environ == {}
    with pytest.raises(EnvError, match=r"^ABPLAT_ENV_FILE='/nonexistent/.env': no such file \(unset it"):
        load_env_file({"ABPLAT_ENV_FILE": "/nonexistent/.env"})


def test_this_session_reads_no_env_file():
    # tests/plugin.py: a developer's .env (debug on, another store) must not reach the tests.
    assert os.environ["ABPLAT_ENV_FILE"] == ""


def started(env_file: Path, *args: str, **environ: str) -> subprocess.CompletedProcess:
    """`manage.py *args` reading ``env_file``, with none of this session's ABPLAT_* settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    env = base | {"ABPLAT_ENV_FILE": str(env_file), "ABPLAT_VAR": str(env_file.parent / "var")} | environ
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
def test_make_dev_env_writes_the_development_settings_once(tmp_path):
    made = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), "dev-env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("make dev-env: wrote .env (ABPLAT_DEBUG=true)")
    written = (tmp_path / ".env").read_text()
    assert parse_env_file(written, ".env") == {"ABPLAT_DEBUG": "true"}
    assert "docs/deploy.md" in written and (ROOT / "docs" / "deploy.md").is_file()
    (tmp_path / ".env").write_text("ABPLAT_DEBUG=true\nABPLAT_LOG_LEVEL=ERROR\n")  # the developer's own
    again = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), "dev-env"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and again.stdout == ""
    assert (tmp_path / ".env").read_text() == "ABPLAT_DEBUG=true\nABPLAT_LOG_LEVEL=ERROR\n"
    ignored = subprocess.run(["git", "check-ignore", ".env"], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.strip() == ".env"


@pytest.mark.process
def test_manage_py_reads_the_file_and_the_deploy_check_still_fails_with_debug_on(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("# development\nABPLAT_DEBUG=true\n")
    # Debug on from the file: no key needed, and the deploy check refuses it.
    result = started(env_file, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode != 0 and "security.W018" in result.stderr, result.stderr
    # The environment wins over the file: production's own settings pass.
    result = started(
        env_file,
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        ABPLAT_DEBUG="false",
        ABPLAT_SECRET_KEY=DEPLOY_KEY,
        ABPLAT_ALLOWED_HOSTS="abplat.example.com",
        ABPLAT_SSL_REDIRECT="true",
        ABPLAT_SECURE_COOKIES="true",
    )
    assert result.returncode == 0 and "no issues" in result.stdout, result.stderr


@pytest.mark.process
def test_a_bad_line_stops_manage_py_the_celery_app_and_gunicorn_with_one_line(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("ABPLAT_DEBUG=true\nABPLAT_DEBUG true\n")
    says = f"abplat: configuration error: {env_file}, line 2: not NAME=value (a comment line starts with #)"
    result = started(env_file, "check")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [says]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    env["ABPLAT_ENV_FILE"] = str(env_file)
    for argv in (
        [sys.executable, "-m", "celery", "-A", "abplat", "inspect", "ping"],
        [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "gunicorn.conf.py"), "abplat.wsgi"],
    ):
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and result.stderr.strip().endswith(says), (argv, result.stderr[-2000:])
