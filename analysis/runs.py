"""Which runs a report reads: the run catalog (samples.store.SampleStore.runs) against the runs
that have samples, under the analyst's status and mode filters.

The rule (docs/report-json.md, "Runs"):
- by default a report reads runs whose catalog status is ``done`` and runs without a catalog row
  (data loaded by tools and tests, taken as complete); running, cancelled and failed runs are
  partial and are read only when asked for (``Filters.status``), and then labelled;
- runs of different modes (split, mirror, live) are never mixed unless asked (``Filters.mode``):
  by default the report reads the mode of the latest completed run (the run whose newest sample
  is the newest) and lists the other modes' runs as available;
- a live run (mode ``live``: real users' traffic recorded by the gateway, one run per gateway
  process start) has no end to wait for: while its gateway serves it is read as it stands, like
  a completed run, never as partial, whether it has no catalog row or one saying ``running``.
  When live traffic is the newest, the default mode is therefore live, and the replays' runs
  are listed as available beside it (and the other way round);
- a run asked for by id (``Filters.run_id``) is read whatever its status or mode, labelled.

Pure: the catalog, the data version and the modes per run come in as values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from analysis.definitions import Filters

DEFAULT_STATUSES = ("done",)
# The status a run without a catalog row is given: complete (tools and tests load whole runs).
UNCATALOGUED = "uncatalogued"
PARTIAL = ("running", "cancelled", "failed")
LIVE = "live"  # samples.columns.MODES: the gateway's recording of real traffic


def _read_as(run: Mapping[str, Any]) -> str:
    """The status a run is filtered by: a run without a catalog row, or a live run still
    recording, counts as done."""
    if run["status"] == UNCATALOGUED or (run["mode"] == LIVE and run["status"] == "running"):
        return "done"
    return str(run["status"])


@dataclasses.dataclass(frozen=True)
class RunSelection:
    runs: tuple[int, ...] | None  # Filters.runs: None when every run with samples is read
    mode: str | None  # the mode read (None: no run)
    info: dict[str, Any]  # the report's "runs" key
    banners: list[str]


def _label(run: Mapping[str, Any]) -> str:
    return f"{run['status']} run {run['run_id']}"


def select_runs(
    filters: Filters,
    version: Sequence[Sequence[int]],
    catalog: Sequence[Mapping[str, Any]],
    modes_of: Callable[[], Mapping[int, str]],
) -> RunSelection:
    """The runs of a report. version: RawReader.data_version rows (run_id, rows, sum, newest
    recorded_ms) of the runs with samples; catalog: SampleStore.runs(experiment); modes_of():
    {run_id: mode} from the samples (called only when a run without a catalog row must be
    placed, since it costs a scan)."""
    newest = {int(v[0]): int(v[3]) for v in version}
    cat = {int(c["run_id"]): c for c in catalog}
    sample_modes: Mapping[int, str] = {}
    if any(r not in cat for r in newest) and (len({*newest, *cat}) > 1 or filters.mode is not None):
        sample_modes = modes_of()
    known: dict[int, dict[str, Any]] = {}
    for run_id in sorted({*newest, *cat}):
        c = cat.get(run_id)
        run = {
            "run_id": run_id,
            "status": c["status"] if c else UNCATALOGUED,
            "mode": (c["mode"] if c else sample_modes.get(run_id)) or None,
            "samples": run_id in newest,
        }
        known[run_id] = {**run, "partial": _read_as(run) in PARTIAL}
    statuses = tuple(filters.status) or DEFAULT_STATUSES

    def by_status(run: Mapping[str, Any]) -> bool:
        return _read_as(run) in statuses

    if filters.run_id is not None:
        picked = [known[filters.run_id]] if filters.run_id in known else []
        excluded: list[dict[str, Any]] = []
        mode = picked[0]["mode"] if picked else None
        mode_source = "the run asked for"
    else:
        eligible = [r for r in known.values() if r["samples"] and by_status(r)]
        excluded = [{**r, "reason": "status"} for r in known.values() if r["samples"] and not by_status(r)]
        if filters.mode is not None:
            mode, mode_source = filters.mode, "filter"
        else:
            done = [r for r in eligible if _read_as(r) == "done" and r["mode"]]
            pool = done or [r for r in eligible if r["mode"]]
            latest = max(pool, key=lambda r: (newest.get(r["run_id"], 0), r["run_id"]), default=None)
            mode = latest["mode"] if latest else None
            if latest:
                mode_source = f"the latest completed run ({latest['run_id']})"
            else:  # one run without a catalog row (its mode was not looked up) or no run
                mode_source = "the only run" if eligible else "no run"
        picked = [r for r in eligible if mode is None or r["mode"] in (mode, None)]
        excluded += [{**r, "reason": "mode"} for r in eligible if r not in picked]
    available: dict[str, list[int]] = {}
    for r in excluded:
        if r["reason"] == "mode":
            available.setdefault(str(r["mode"]), []).append(r["run_id"])
    banners = [f"includes {_label(r)}: partial" for r in picked if r["partial"]]
    notes = []
    skipped = [r for r in excluded if r["reason"] == "status"]
    if skipped:
        notes.append(
            "not read (not completed): " + ", ".join(_label(r) for r in skipped)
            + "; ask for them with the status filter"
        )  # fmt: skip
    for m, ids in sorted(available.items()):
        notes.append(f"{m} runs {ids} are available with mode={m} (runs of two modes are never mixed)")
    every = [r for r in known.values() if r["samples"]]
    ids = tuple(r["run_id"] for r in picked)
    runs: tuple[int, ...] | None = None if filters.run_id is None and len(ids) == len(every) else ids
    if filters.run_id is not None:
        runs = None  # Filters.run_id restricts the read already
    info = {
        "read": [{k: r[k] for k in ("run_id", "status", "mode", "partial")} for r in picked],
        "not_read": [{k: r[k] for k in ("run_id", "status", "mode", "reason")} for r in excluded],
        "statuses": list(statuses),
        "mode": mode,
        "mode_source": mode_source,
        "available_modes": available,
        "notes": notes,
    }
    return RunSelection(runs, mode, info, banners)
