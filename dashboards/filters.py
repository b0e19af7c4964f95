"""Report filters from GET parameters (page, CSV and API share them): run, since, until, variant."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from analysis.definitions import Filters, QueryError


def _parse_time(name: str, raw: str) -> dt.datetime:
    text = raw.strip().replace("Z", "+00:00")
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(
            f"{name}={raw!r} is not an ISO date-time (e.g. 2024-11-29T17:00 or ...T17:00:00Z)"
        ) from None
    # a browser's datetime-local input has no zone: the dashboard shows UTC throughout
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value


def filters_from_params(
    key: str, get: Mapping[str, str], variants: Sequence[str], known: Sequence[str]
) -> Filters:
    """Raise QueryError naming the bad parameter."""
    run = (get.get("run") or "").strip()
    run_id = None
    if run:
        if not run.isdigit():
            raise QueryError(f"run={run!r} must be a non-negative integer run id")
        run_id = int(run)
    since = _parse_time("since", get["since"]) if (get.get("since") or "").strip() else None
    until = _parse_time("until", get["until"]) if (get.get("until") or "").strip() else None
    chosen = tuple(v for v in variants if v)
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise QueryError(f"variant={unknown} not in experiment {key!r} (has {list(known)})")
    return Filters(key, run_id=run_id, since=since, until=until, variants=chosen)
