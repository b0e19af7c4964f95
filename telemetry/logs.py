"""Structured logs: one JSON object a line, and the context every line of a replay carries.

Stdlib only (the package rule, telemetry/__init__.py). Two parts:

- A context (contextvars) of searchable fields: ``experiment``, ``run``, ``shard``,
  ``variant``, ``request_id`` and, in a Celery task, ``task_id``. The replay's glue, the API and
  the commands bind them with ``log_context(...)``; every record logged inside carries them,
  including records of asyncio tasks started inside (they copy the context) and of threads
  started with ``contextvars.copy_context().run``.
- Two formatters, chosen by ``ABPLAT_LOG_FORMAT`` (LOGGING, abplat/config.py):
  ``TextFormatter`` (the default: the usual line, then the context as ``key=value``) and
  ``JsonFormatter``: ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message``,
  ``exception`` (the traceback as one string) when there is one, the context fields, then any
  ``extra={...}`` fields of the call.

A value from a user (a request id, an experiment key, a message quoting a trace line) can never
forge a field or a line: everything is written by ``json.dumps`` with ASCII escapes, so quotes,
newlines, control characters and Unicode line separators are escaped inside their string, and
the fixed fields are written first and never replaced by a context or extra field of the same
name.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import functools
import inspect
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# Written by the formatter itself: neither a context nor an extra field may take these names.
RESERVED_FIELDS = frozenset({"ts", "level", "logger", "message", "exception", "stack"})

_EMPTY: Mapping[str, Any] = {}
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "abplat_log_context", default=_EMPTY
)

# The attributes every LogRecord has: anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _checked(fields: Mapping[str, Any]) -> Mapping[str, Any]:
    for name in fields:
        if name in RESERVED_FIELDS or not name.isidentifier():
            raise ValueError(
                f"log context field {name!r}: must be an identifier, not one of {', '.join(sorted(RESERVED_FIELDS))}"
            )
    return fields


def bind(**fields: Any) -> contextvars.Token:
    """Add ``fields`` to the current context; a None value removes the field (not known
    here, e.g. a run's finishing task has no shard). Undo with ``reset``; prefer
    ``log_context`` where a ``with`` block fits. (The replay binds per request: kept cheap.)"""
    merged = {**_context.get(), **_checked(fields)}
    if any(v is None for v in fields.values()):  # the context itself never holds a None
        merged = {k: v for k, v in merged.items() if v is not None}
    return _context.set(merged)


def reset(token: contextvars.Token) -> None:
    _context.reset(token)


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Every record logged inside the block (in this thread or task) carries ``fields``."""
    token = bind(**fields)
    try:
        yield
    finally:
        _context.reset(token)


def context_from_args(**fields: str) -> Callable[[Callable], Callable]:
    """Decorator: during each call, bind context fields from the call's arguments
    (``field="argument name"``), e.g. ``@context_from_args(run="run_id", shard="index")``.
    ``bind()`` calls inside the function end with the call too. The wrapper keeps the
    function's signature (Celery checks a task's arguments against it)."""

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func)
        unknown = sorted(arg for arg in fields.values() if arg not in signature.parameters)
        if unknown:
            raise TypeError(f"{func.__qualname__} has no argument(s) {unknown} to log")
        _checked(dict.fromkeys(fields, ""))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return func(*args, **kwargs)  # let the function say what is wrong with the call
            with log_context(**{field: arguments.get(arg) for field, arg in fields.items()}):
                return func(*args, **kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper

    return decorate


def current_context() -> dict[str, Any]:
    """The fields bound here now (a copy)."""
    return dict(_context.get())


def rfc3339_utc(created: float) -> str:
    """Unix seconds -> ``2026-12-01T10:54:41.123Z`` (UTC, milliseconds, truncated)."""
    ms = int(created * 1000)
    stamp = dt.datetime.fromtimestamp(ms // 1000, dt.UTC)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def _finite(value: Any) -> Any:
    """JSON has no NaN or Infinity: write those as strings (only called when one is there)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return value


def _dumps(payload: dict[str, Any]) -> str:
    try:
        return json.dumps(payload, ensure_ascii=True, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:
        return json.dumps(
            _finite(payload), ensure_ascii=True, allow_nan=False, default=str, separators=(",", ":")
        )


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The context and ``extra`` fields of ``record`` (context first; extra wins a tie)."""
    fields = dict(getattr(record, "abplat_context", None) or _context.get())
    for name, value in record.__dict__.items():
        if name not in _RECORD_ATTRS and name != "abplat_context" and not name.startswith("_"):
            fields[name] = value
    return fields


class ContextFilter(logging.Filter):
    """Stamps the context on the record where it is logged, for handlers that format later
    or elsewhere (a QueueHandler); the formatters read it from there first."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "abplat_context"):
            record.abplat_context = _context.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line (the module docstring lists the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": rfc3339_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            payload["exception"] = record.exc_text
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        for name, value in record_fields(record).items():
            if name not in RESERVED_FIELDS:
                payload[name] = value
        return _dumps(payload)


class TextFormatter(logging.Formatter):
    """The usual text line, then the context as ``key=value``, then a traceback if any. Values
    with spaces, quotes or control characters are quoted and escaped: a context value never
    breaks the line (JSON logs are the format for messages that quote users' text)."""

    def __init__(self, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s", **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)  # a traceback, if any, follows the context
        fields = getattr(record, "abplat_context", None) or _context.get()
        if not fields:
            return line
        parts = []
        for name, value in fields.items():
            text = str(value)
            if not text or any(c.isspace() or c in "\"'=\\" or not c.isprintable() for c in text):
                text = json.dumps(text, ensure_ascii=True)
            parts.append(f"{name}={text}")
        return f"{line} [{' '.join(parts)}]"
