"""Client-side parameter binding shared by both backends, so the same SQL means the same thing.

clickhouse-driver's `%(name)s` style, but strict: only types with one unambiguous literal are
accepted, and anything else is an error naming the parameter. ClickHouse 18.16 has no
server-side `{x:T}` parameters, and chDB has no driver, so we quote here for both.
Pure: stdlib only.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Any

_ESCAPES = {
    "\\": "\\\\",
    "'": "\\'",
    "\b": "\\b",
    "\f": "\\f",
    "\r": "\\r",
    "\n": "\\n",
    "\t": "\\t",
    "\0": "\\0",
    "\a": "\\a",
    "\v": "\\v",
}


class ParamError(ValueError):
    pass


def quote(value: Any, name: str = "?") -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"  # no Bool type on 18.16; flags are UInt8
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ParamError(f"SQL parameter {name!r}: non-finite float {value!r}")
        return repr(value)
    if isinstance(value, str):
        return "'" + "".join(_ESCAPES.get(ch, ch) for ch in value) + "'"
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ParamError(f"SQL parameter {name!r}: naive datetime {value!r}; pass UTC-aware")
        utc = value.astimezone(dt.UTC)
        return f"toDateTime('{utc:%Y-%m-%d %H:%M:%S}', 'UTC')"
    if isinstance(value, list | tuple | set | frozenset):
        if not value:
            raise ParamError(f"SQL parameter {name!r}: empty collection has no literal for IN")
        items = sorted(value) if isinstance(value, set | frozenset) else value
        inner = ", ".join(quote(v, f"{name}[]") for v in items)
        # list -> Array literal; tuple/set -> (a, b) for `x IN %(p)s`.
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    raise ParamError(f"SQL parameter {name!r}: unsupported type {type(value).__name__}")


def bind(sql: str, params: Mapping[str, Any] | None) -> str:
    """Substitute %(name)s placeholders; without params the SQL is returned untouched (as the
    driver does), so a literal % needs doubling only when params are given."""
    if params is None:
        return sql
    if not isinstance(params, Mapping):
        raise ParamError(f"SQL parameters must be a mapping of name -> value, got {params!r}")
    quoted = {k: quote(v, k) for k, v in params.items()}
    try:
        return sql % quoted
    except KeyError as e:
        raise ParamError(f"SQL uses parameter {e.args[0]!r} that was not given") from None
    except (TypeError, ValueError) as e:
        raise ParamError(f"SQL placeholders do not match the parameters: {e}") from None
