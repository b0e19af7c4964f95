"""Strict parsers for settings read from an environment.

A bad value fails at start with a message naming the variable and what it accepts, never a
silent fallback (healthchecks' ``envbool``). No Django imports: abplat/config.py calls these
before Django is configured, and they raise plain ``ImproperlyConfigured``-compatible errors.

``Reader(environ)`` parses any mapping (abplat/config.py: ``settings_from(environ)``, which tests
call with a dict); the module-level ``env_*`` functions read the process environment at each call
(gunicorn.conf.py).

``load_env_file(environ)``: the development settings file (``.env`` beside manage.py, which
``make dev-env`` writes) read into the environment before anything else reads it. manage.py,
the Celery app and gunicorn.conf.py call it; production sets its own environment
(docs/deploy.md) and has no such file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from urllib.parse import urlsplit


class EnvError(Exception):
    """Raised for an environment variable with a value we do not accept."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Reader:
    """The strict parsers over one mapping of variable names to values (``os.environ``, a dict)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def env_str(self, name: str, default: str = "") -> str:
        return self.environ.get(name, default).strip()

    def env_bool(self, name: str, default: bool) -> bool:
        raw = self.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise EnvError(f"Unexpected value {name}={raw!r}: use one of 1/0, true/false, yes/no, on/off.")

    def env_int(
        self, name: str, default: int, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        raw = self.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            raise EnvError(f"Unexpected value {name}={raw!r}: use a whole number.") from None
        if minimum is not None and value < minimum or maximum is not None and value > maximum:
            raise EnvError(f"Unexpected value {name}={raw!r}: use a number in [{minimum}, {maximum}].")
        return value

    def env_list(self, name: str, default: list[str]) -> list[str]:
        raw = self.environ.get(name)
        if raw is None or raw.strip() == "":
            return list(default)
        items = [item.strip() for item in raw.split(",")]
        if any(item == "" for item in items):
            raise EnvError(
                f"Unexpected value {name}={raw!r}: use a comma-separated list without empty items."
            )
        return items

    def env_url(self, name: str, default: str, *, schemes: tuple[str, ...]) -> str:
        """A URL whose scheme is one of ``schemes``; empty means "use the embedded default"."""
        raw = self.environ.get(name)
        value = default if raw is None else raw.strip()
        if value == "":
            return ""
        parts = urlsplit(value)
        if parts.scheme not in schemes:
            raise EnvError(
                f"Unexpected value {name}={value!r}: the scheme must be one of "
                f"{', '.join(s + '://' for s in schemes)}."
            )
        if parts.scheme not in {"sqlite", "memory", "filesystem"} and not parts.hostname:
            raise EnvError(f"Unexpected value {name}={value!r}: the URL names no host.")
        return value

    def env_endpoints(self, name: str) -> list[tuple[str, int]]:
        """``host:port,host:port`` (etcd cluster members). Empty means none."""
        out = []
        for item in self.env_list(name, []):
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise EnvError(
                    f"Unexpected value {name}={self.environ.get(name)!r}: item {item!r} is not host:port."
                )
            out.append((host, int(port)))
        return out

    def env_choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        """One of ``choices`` (case-insensitive); empty means ``default``."""
        raw = self.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        value = raw.strip().lower()
        if value not in choices:
            raise EnvError(f"Unexpected value {name}={raw!r}: use one of {', '.join(choices)}.")
        return value


# ---- the development settings file ----

ENV_FILE_VARIABLE = "ABPLAT_ENV_FILE"
DEFAULT_ENV_FILE = Path(__file__).resolve().parent.parent / ".env"  # beside manage.py
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env_file(text: str, where: str) -> dict[str, str]:
    """The ``NAME=value`` lines of an env file (the subset systemd's EnvironmentFile and the
    shells agree on): blank lines and lines starting with ``#`` are skipped, a value in matching
    single or double quotes loses them. Anything else is an EnvError naming ``where`` and the
    line; a line's value is never repeated in it (it may be a password)."""
    values: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.partition("=")
        name, value = name.strip(), value.strip()
        at = f"{where}, line {number}"
        if not sep:
            raise EnvError(f"{at}: not NAME=value (a comment line starts with #)")
        if not _NAME.fullmatch(name):
            raise EnvError(f"{at}: {name[:40]!r} is not a variable name (letters, digits and _)")
        if name in values:
            raise EnvError(f"{at}: {name} is set twice (also on line {lines[name]})")
        if value[:1] in ("'", '"'):
            if len(value) < 2 or value[-1] != value[0]:
                raise EnvError(f"{at}: {name}'s value opens a quote it does not close")
            value = value[1:-1]
        elif " #" in value:
            raise EnvError(
                f"{at}: {name}'s value holds ' #': put the comment on a line of its own, or quote the value"
            )
        values[name] = value
        lines[name] = number
    return values


def load_env_file(environ: MutableMapping[str, str], default: Path = DEFAULT_ENV_FILE) -> Path | None:
    """Read the env file into ``environ`` without replacing a variable already set there (the
    environment wins); the path read, or None. Which file: ``ABPLAT_ENV_FILE``, else ``default``
    when it exists; ``ABPLAT_ENV_FILE=""`` reads none (the test suite sets it: a developer's
    file must not change what tests see). A file named but missing, unreadable or with a bad
    line: EnvError naming it."""
    named = environ.get(ENV_FILE_VARIABLE)
    if named is not None and not named.strip():
        return None
    path = Path(named.strip()) if named is not None else default
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if named is None:
            return None
        raise EnvError(
            f"{ENV_FILE_VARIABLE}={named!r}: no such file (unset it to read .env beside manage.py, "
            "or set it empty to read none)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise EnvError(f"{path}: cannot read it: {reason}") from None
    for name, value in parse_env_file(text, str(path)).items():
        environ.setdefault(name, value)
    return path


# The same parsers over the process environment, read when called (not when this module loaded).


def env_str(name: str, default: str = "") -> str:
    return Reader(os.environ).env_str(name, default)


def env_bool(name: str, default: bool) -> bool:
    return Reader(os.environ).env_bool(name, default)


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    return Reader(os.environ).env_int(name, default, minimum=minimum, maximum=maximum)


def env_list(name: str, default: list[str]) -> list[str]:
    return Reader(os.environ).env_list(name, default)


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    """A URL whose scheme is one of ``schemes``; empty means "use the embedded default"."""
    return Reader(os.environ).env_url(name, default, schemes=schemes)


def env_endpoints(name: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (etcd cluster members). Empty means none."""
    return Reader(os.environ).env_endpoints(name)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive); empty means ``default``."""
    return Reader(os.environ).env_choice(name, default, choices)
