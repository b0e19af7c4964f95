"""How the report names the runs it reads and holds back (analysis.runs): "<status> run <id>",
unless the glue labelled the catalog row (a capacity step); a labelled run stopped on purpose
once it had what it was for (``complete``) is not partial, one cut short still is."""

from __future__ import annotations

from analysis.definitions import Filters
from analysis.runs import select_runs

EXP = "cat"
STEP = "capacity step run {id} (fp16 at {rate} req/s: {verdict})"


def version(*run_ids: int) -> list[tuple[int, int, int, int]]:
    return [(r, 100, 100, 1_000 + r) for r in run_ids]


def row(run_id: int, status: str, mode: str = "mirror", **extra) -> dict:
    return {"run_id": run_id, "status": status, "mode": mode, **extra}


def catalog() -> list[dict]:
    return [
        row(1, "done"),
        row(2, "cancelled", label=STEP.format(id=2, rate=32, verdict="meets"), complete=True),
        row(3, "cancelled", label=STEP.format(id=3, rate=64, verdict="misses"), complete=True),
        # the search failed while this step replayed: cut short, whatever its label says
        row(4, "cancelled", label="capacity step run 4 (fp16 at 45.5 req/s: cut short, the search failed)"),
        row(5, "cancelled"),  # an ordinary replay someone cancelled
    ]


def select(**filters):
    return select_runs(Filters(EXP, **filters), version(1, 2, 3, 4, 5), catalog(), lambda: {})


def test_held_back_steps_are_named_as_steps_apart_from_the_runs_not_completed():
    notes = select().info["notes"]
    assert notes == [
        "not read (not completed): capacity step run 4 (fp16 at 45.5 req/s: cut short, the search failed), "
        "cancelled run 5; ask for them with the status filter",
        "not read (status cancelled): capacity step run 2 (fp16 at 32 req/s: meets), "
        "capacity step run 3 (fp16 at 64 req/s: misses); open one by its run id",
    ]
    assert not any("cancelled run 2" in n or "cancelled run 3" in n for n in notes)
    labels = {r["run_id"]: r["label"] for r in select().info["not_read"] if "label" in r}
    assert labels == {
        2: STEP.format(id=2, rate=32, verdict="meets"),
        3: STEP.format(id=3, rate=64, verdict="misses"),
        4: "capacity step run 4 (fp16 at 45.5 req/s: cut short, the search failed)",
    }


def test_a_step_that_decided_read_by_id_is_named_and_not_partial():
    sel = select(run_id=3)
    assert sel.banners == []
    assert sel.info["read"] == [
        {
            "run_id": 3,
            "status": "cancelled",
            "mode": "mirror",
            "partial": False,
            "label": STEP.format(id=3, rate=64, verdict="misses"),
        }
    ]
    assert sel.info["notes"] == ["read: capacity step run 3 (fp16 at 64 req/s: misses)"]


def test_a_step_cut_short_and_a_cancelled_replay_still_say_partial():
    assert select(run_id=4).banners == [
        "includes capacity step run 4 (fp16 at 45.5 req/s: cut short, the search failed): partial"
    ]
    assert select(run_id=5).banners == ["includes cancelled run 5: partial"]
    everything = select(status=("done", "running", "cancelled", "failed"))
    assert everything.banners == [
        "includes capacity step run 4 (fp16 at 45.5 req/s: cut short, the search failed): partial",
        "includes cancelled run 5: partial",
    ]
    assert [r["partial"] for r in everything.info["read"]] == [False, False, False, True, True]


def test_complete_without_a_label_changes_nothing_and_blank_labels_are_ignored():
    cat = [row(1, "done"), row(2, "cancelled", complete=True), row(3, "cancelled", label="  ")]
    sel = select_runs(Filters(EXP, status=("done", "cancelled")), version(1, 2, 3), cat, lambda: {})
    assert sel.banners == ["includes cancelled run 2: partial", "includes cancelled run 3: partial"]
