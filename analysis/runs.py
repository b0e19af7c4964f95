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

How runs are named in notes and banners: "<status> run <id>" ("cancelled run 12"), unless the
glue gave the catalog row a ``label`` of its own, saying what the run was for (a capacity step:
"capacity step run 12 (fp16 at 64 req/s: misses)"). A labelled run may also carry
``complete: True``: it was stopped on purpose once it had what it was for (a capacity step that
decided), so a cancelled status does not make it partial; it is still held back by the status
filter like any cancelled run (listed by its label, to be opened by id), and read by id without
a "partial" banner.

Pure: the catalog (with any labels), the data version and the modes per run come in as values.
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


def _entry(run: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """A run as the report's "runs" key lists it; with its ``label`` when the glue gave one."""
    return {k: run[k] for k in keys} | ({"label": run["label"]} if run["labelled"] else {})


@dataclasses.dataclass(frozen=True)
class RunSelection:
    runs: tuple[int, ...] | None  # Filters.runs: None when every run with samples is read
    mode: str | None  # the mode read (None: no run)
    info: dict[str, Any]  # the report's "runs" key
    banners: list[str]


def _label(run: Mapping[str, Any], given: Any = None) -> str:
    """What notes and banners call a run: the glue's label for it, else "<status> run <id>"."""
    if isinstance(given, str) and given.strip():
        return given.strip()
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
        given = c.get("label") if c else None
        labelled = isinstance(given, str) and bool(given.strip())
        complete = labelled and c is not None and c.get("complete") is True
        known[run_id] = {
            **run,
            "partial": _read_as(run) in PARTIAL and not complete,
            "label": _label(run, given),
            "labelled": labelled,
        }
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
    banners = [f"includes {r['label']}: partial" for r in picked if r["partial"]]
    notes = []
    named = [r for r in picked if r["labelled"] and not r["partial"]]
    if named:
        notes.append("read: " + ", ".join(r["label"] for r in named))
    skipped = [r for r in excluded if r["reason"] == "status"]
    if cut := [r for r in skipped if r["partial"] or not r["labelled"]]:
        notes.append(
            "not read (not completed): "
            + ", ".join(r["label"] for r in cut)
            + "; ask for them with the status filter"
        )
    if ended := [r for r in skipped if not r["partial"] and r["labelled"]]:
        notes.append(
            "not read (status "
            + "/".join(sorted({str(r["status"]) for r in ended}))
            + "): "
            + ", ".join(r["label"] for r in ended)
            + "; open one by its run id"
        )
    for m, ids in sorted(available.items()):
        notes.append(f"{m} runs {ids} are available with mode={m} (runs of two modes are never mixed)")
    every = [r for r in known.values() if r["samples"]]
    ids = tuple(r["run_id"] for r in picked)
    runs: tuple[int, ...] | None = None if filters.run_id is None and len(ids) == len(every) else ids
    if filters.run_id is not None:
        runs = None  # Filters.run_id restricts the read already
    info = {
        "read": [_entry(r, ("run_id", "status", "mode", "partial")) for r in picked],
        "not_read": [_entry(r, ("run_id", "status", "mode", "reason")) for r in excluded],
        "statuses": list(statuses),
        "mode": mode,
        "mode_source": mode_source,
        "available_modes": available,
        "notes": notes,
    }
    return RunSelection(runs, mode, info, banners)
