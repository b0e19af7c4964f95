"""What the report calls the runs of capacity steps: "capacity step run 12 (fp16 at 64 req/s:
misses)", never "cancelled run 12" for a step that decided and stopped its own run.

The report (analysis.runs) labels runs from the catalog rows it is given; the glue that reads the
catalog (dashboards.reports.report_for) asks every app for labels through the run_labels signal,
and this receiver answers for the capacity searches of the experiment (CapacityConfig.ready
connects it), so the report's layer never imports capacity.

A run is a step when a search's stored result names it (models.CapacitySearch.result: a
variant's ``steps`` carry their run ids, and while a variant is searched its ``searching`` entry
names the step replaying now, capacity.service.searching_entry). A recorded step ended on its own
terms (met, missed, or stayed undecided): ``complete``, so its cancelled status is not partial.
The step replaying now is partial while the search runs, and cut short once the search failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from capacity.models import CapacitySearch
from capacity.search import rate_text


def step_label(run_id: int, variant: str, rate_rps: float, what: str) -> str:
    return f"capacity step run {run_id} ({variant} at {rate_text(rate_rps)} req/s: {what})"


def _what(step: Mapping[str, Any]) -> str:
    """A recorded step's outcome: its verdict, and whether the load generator voided it."""
    note = str(step.get("note") or "")
    if not step.get("counted", True):
        return f"{step['verdict']}, not counted: the load generator lagged"
    if note.startswith("void"):
        return f"{step['verdict']}, void: the load generator lagged"
    return str(step["verdict"])


def search_labels(searches: Iterable[CapacitySearch]) -> dict[int, dict[str, Any]]:
    """{run_id: {"label", "complete"}} for every step run the searches name (newest first: a
    run named twice keeps the newest search's name, which cannot happen but costs nothing)."""
    out: dict[int, dict[str, Any]] = {}
    for search in searches:
        for variant, entry in (search.result or {}).items():
            if not isinstance(entry, Mapping):
                continue
            for step in entry.get("steps") or ():
                if step.get("run_id") is not None and step["run_id"] not in out:
                    label = step_label(step["run_id"], variant, step["rate_rps"], _what(step))
                    out[int(step["run_id"])] = {"label": label, "complete": True}
            now = entry.get("searching")
            if now and now.get("run_id") is not None and now["run_id"] not in out:
                if search.status == CapacitySearch.Status.RUNNING:
                    what = "replaying"
                else:
                    what = "cut short, the search failed"
                label = step_label(now["run_id"], variant, now["rate_rps"], what)
                out[int(now["run_id"])] = {"label": label, "complete": False}
    return out


def step_run_labels(sender: Any, *, experiment: str, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """The run_labels receiver: the labels of the experiment's capacity step runs."""
    return search_labels(CapacitySearch.objects.filter(experiment__key=experiment).only("status", "result"))
