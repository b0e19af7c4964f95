"""Strict parsers for settings read from the environment.

A bad value fails at start with a message naming the variable and what it accepts, never a
silent fallback (healthchecks' ``envbool``). No Django imports: settings.py calls these before
Django is configured, and they raise plain ``ImproperlyConfigured``-compatible errors.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit


class EnvError(Exception):
    """Raised for an environment variable with a value we do not accept."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"Unexpected value {name}={raw!r}: use one of 1/0, true/false, yes/no, on/off.")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(f"Unexpected value {name}={raw!r}: use a whole number.") from None
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        raise EnvError(f"Unexpected value {name}={raw!r}: use a number in [{minimum}, {maximum}].")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    items = [item.strip() for item in raw.split(",")]
    if any(item == "" for item in items):
        raise EnvError(f"Unexpected value {name}={raw!r}: use a comma-separated list without empty items.")
    return items


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    """A URL whose scheme is one of ``schemes``; empty means "use the embedded default"."""
    raw = os.environ.get(name)
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


def env_endpoints(name: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (etcd cluster members). Empty means none."""
    out = []
    for item in env_list(name, []):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EnvError(
                f"Unexpected value {name}={os.environ.get(name)!r}: item {item!r} is not host:port."
            )
        out.append((host, int(port)))
    return out


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive); empty means ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise EnvError(f"Unexpected value {name}={raw!r}: use one of {', '.join(choices)}.")
    return value
