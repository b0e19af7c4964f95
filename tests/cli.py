"""Running management commands as a script would: --json documents and their failures
(experiments.cli), in this process or as a separate one."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

ROOT = Path(__file__).resolve().parents[1]


def as_json(*args, stderr=None, **kw) -> dict:
    """`call_command(*args, "--json")`; the whole of its stdout parsed as one JSON document."""
    out = io.StringIO()
    call_command(*args, "--json", stdout=out, stderr=stderr or io.StringIO(), **kw)
    return json.loads(out.getvalue())


def failing(*args, **kw) -> tuple[CommandError, dict]:
    """The same for a command that must fail: its CommandError and the error document."""
    out = io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command(*args, "--json", stdout=out, stderr=io.StringIO(), **kw)
    return info.value, json.loads(out.getvalue())


def own_env(var: Path) -> dict:
    """The environment of a `manage.py` process with its own embedded parts under ``var``
    (SQLite, chDB, weights) and debug on: none of this session's ABPLAT_* settings, and no env
    file (tests/plugin.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    return env | {"ABPLAT_VAR": str(var), "ABPLAT_DEBUG": "true"}


def command_line(env: dict, *args: str) -> tuple[int, dict, str]:
    """`python manage.py *args` on the real command line: exit status, stdout parsed as one
    JSON document, stderr."""
    r = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        return r.returncode, json.loads(r.stdout), r.stderr
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON document: {r.stdout[-2000:]!r}\nstderr: {r.stderr[-2000:]}")


def as_typed(name: str, *args: str) -> tuple[int, str, str]:
    """`manage.py NAME *args` as typed on a terminal, run in this process: the command line
    parsed by the command's own parser, a failure printed as the terminal shows it. Exit
    status, stdout, stderr. (Django's run_from_argv would also close this test's database
    connection on the way out: the rest of it is what runs here.)"""
    from importlib import import_module

    from django.core.management import get_commands

    out, err = io.StringIO(), io.StringIO()
    command = import_module(f"{get_commands()[name]}.management.commands.{name}").Command(
        stdout=out, stderr=err
    )
    options = vars(command.create_parser("manage.py", name).parse_args(list(args)))
    command._called_from_command_line = True
    try:
        command.execute(*options.pop("args", ()), **options)
    except SystemExit as exited:
        return exited.code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()
