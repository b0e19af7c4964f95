"""The run catalog: SampleStore.record_run / runs on chDB and the server."""

from __future__ import annotations

import pytest

from samples.store import StoreUnavailable


def test_record_and_read_the_latest_status(store):
    assert store.runs("exp") == []
    store.record_run(12, "exp", "split", "running", started_ms=1_000)
    store.record_run(13, "exp", "mirror", "running", started_ms=2_000)
    store.record_run(12, "exp", "split", "cancelled", finished_ms=1_500)
    store.record_run(12, "other", "mirror", "done")  # another experiment's run 12
    got = {r["run_id"]: r for r in store.runs("exp")}
    assert [r["run_id"] for r in store.runs("exp")] == [12, 13]
    assert (got[12]["status"], got[12]["mode"], got[12]["source"]) == ("cancelled", "split", "replay")
    assert (got[12]["started_ms"], got[12]["finished_ms"]) == (1_000, 1_500)  # 0 keeps what was recorded
    assert (got[13]["status"], got[13]["mode"]) == ("running", "mirror")
    assert [r["status"] for r in store.runs("other")] == ["done"]


def test_idempotent_and_the_latest_terminal_status_wins(store):
    for _ in range(3):
        store.record_run(1, "exp", "split", "running")
    store.record_run(1, "exp", "split", "done")
    store.record_run(1, "exp", "split", "done")
    assert [(r["run_id"], r["status"]) for r in store.runs("exp")] == [(1, "done")]
    # a delayed retry of the 'running' record never reopens a finished run
    store.record_run(1, "exp", "split", "running")
    assert store.runs("exp")[0]["status"] == "done"
    store.record_run(1, "exp", "split", "failed")  # a later terminal status does replace it
    assert store.runs("exp")[0]["status"] == "failed"
    store.execute("OPTIMIZE TABLE runs FINAL")  # merged or not, the same answer
    assert store.runs("exp")[0]["status"] == "failed"


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((1, "exp", "split", "finished"), {}, "status must be one of"),
        ((1, "exp", "shadow", "done"), {}, "mode must be one of"),
        ((-1, "exp", "split", "done"), {}, "run_id must be a non-negative integer"),
        ((True, "exp", "split", "done"), {}, "run_id must be a non-negative integer"),
        ((1, "", "split", "done"), {}, "experiment must be a non-empty key"),
        ((1, "exp", "split", "done"), {"started_ms": -5}, "started_ms must be a non-negative"),
        ((1, "exp", "split", "done"), {"source": ""}, "source must be a non-empty"),
    ],
)
def test_bad_arguments_are_value_errors_and_write_nothing(store, args, kw, match):
    with pytest.raises(ValueError, match=match):
        store.record_run(*args, **kw)
    assert store.runs("exp") == []


def test_a_store_that_is_down_raises_store_unavailable(make_store, flaky_server):
    proxy, url = flaky_server
    store = make_store("server", url=url, backoff_s=(0.01,))
    store.migrate()
    proxy.down()
    with pytest.raises(StoreUnavailable):
        store.record_run(1, "exp", "split", "running")
    proxy.up()
    store.record_run(1, "exp", "split", "running")
    assert store.runs("exp")[0]["status"] == "running"
