"""Report filters from GET parameters (page, CSV and API share them): run, since, until, variant,
status (run catalog statuses, comma-separated or repeated; "all" for every one) and mode."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence

from analysis.definitions import MODES, RUN_STATUSES, Filters, QueryError

_RUN_ID = re.compile(r"^[0-9]+$")
MAX_RUN_ID = 2**63 - 1  # the largest id the database's BigAutoField (and UInt64) holds


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


def _statuses(raw: Sequence[str]) -> tuple[str, ...]:
    names = [x.strip() for item in raw for x in (item or "").split(",") if x.strip()]
    if "all" in names:
        return RUN_STATUSES
    bad = sorted({x for x in names if x not in RUN_STATUSES})
    if bad:
        raise QueryError(f"status={bad} unknown: each one of {', '.join(RUN_STATUSES)}, or all")
    return tuple(dict.fromkeys(names))


def filters_from_params(
    key: str,
    get: Mapping[str, str],
    variants: Sequence[str],
    known: Sequence[str],
    statuses: Sequence[str] | None = None,
) -> Filters:
    """Raise QueryError naming the bad parameter. statuses: the repeated `status` values (a
    QueryDict's getlist); without it, get["status"] (comma-separated)."""
    run = (get.get("run") or "").strip()
    run_id = None
    if run:
        # ASCII digits only: str.isdigit() also accepts "²", which int() then rejects
        # length first: int() of thousands of digits raises (and costs) before any comparison
        if not _RUN_ID.match(run) or len(run) > len(str(MAX_RUN_ID)) or int(run) > MAX_RUN_ID:
            shown = run if len(run) <= 40 else run[:40] + "..."
            raise QueryError(f"run={shown!r} must be a run id: a whole number from 0 to {MAX_RUN_ID}")
        run_id = int(run)
    since = _parse_time("since", get["since"]) if (get.get("since") or "").strip() else None
    until = _parse_time("until", get["until"]) if (get.get("until") or "").strip() else None
    chosen = tuple(v for v in variants if v)
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise QueryError(f"variant={unknown} not in experiment {key!r} (has {list(known)})")
    status = _statuses(statuses if statuses is not None else [get.get("status") or ""])
    mode = (get.get("mode") or "").strip() or None
    if mode is not None and mode not in MODES:
        raise QueryError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    return Filters(key, run_id=run_id, since=since, until=until, variants=chosen, status=status, mode=mode)
