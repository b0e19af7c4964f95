"""The gateway's own time is a phase of a live request's TTFT (analysis.definitions.PHASES
"gateway"): the report's split of missed requests shows it for live runs, from the raw samples and
from a rollup alike, and a replay's lateness stays its schedule lag. Live rows recorded before
samples had gateway_ms held that time in schedule_lag_ms: they split the same."""

from __future__ import annotations

import pytest

from analysis import definitions as q
from analysis import report as r
from analysis import rollup
from samples.rows import SampleContext, row_from
from streaming.result import Outcome, StreamResult
from tests.samples.conftest import sample_row

EXP = "gw-phase"
LIVE_RUN = 10**12 + 7  # gateway.models.LIVE_RUN_ID_BASE + a LiveRun's pk
OLD_LIVE_RUN = LIVE_RUN + 1
REPLAY_RUN = 31
GATEWAY_MS = {"fp16": 5.0, "awq": 15.0}
SLO = q.Slo(200.0)  # every request below misses it: TTFT 260 ms and more


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def info() -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=EXP,
        name=EXP,
        slo=SLO,
        target=0.9,
        variants=[r.VariantInfo("fp16", True, 50, {}), r.VariantInfo("awq", False, 50, {})],
    )


def result(i: int) -> StreamResult:
    return StreamResult(
        outcome=Outcome.OK,
        http_status=200,
        ttfb_ms=100.0,
        first_byte_ms=101.0,
        ttft_event_ms=250.0,
        ttft_ms=260.0 + i // 2 % 10,
        e2e_ms=900.0,
        output_tokens=8,
        chunks=8,
    )


def live_rows(run_id: int, n: int = 40) -> list:
    """What the gateway records (gateway.recording builds the same context)."""
    rows = []
    for i in range(n):
        variant = ("fp16", "awq")[i % 2]
        rows.append(
            row_from(
                result(i),
                SampleContext(
                    experiment=EXP,
                    run_id=run_id,
                    seq=i + 1,
                    variant=variant,
                    mode="live",
                    sent_unix_ms=1_732_900_000_000.0 + i,
                    request_id=f"gw-{i}",
                    user_id=f"u{i}",
                    config_revision=3,
                    gateway_ms=GATEWAY_MS[variant],
                    max_tokens=8,
                    worker="gw:1",
                ),
            )
        )
    return rows


def phases(rep: dict, variant: str) -> dict[str, float]:
    return {p: d["mean_ms"] for p, d in rep["phases"][variant]["phases"].items()}


def test_a_live_run_s_misses_show_the_gateway_s_time_as_its_own_phase(store):
    store.insert_samples(live_rows(LIVE_RUN))
    rep = r.build_report(store, info(), q.Filters(EXP, mode="live"))
    assert rep["modes"] == {"live": 40}
    for variant, gateway in GATEWAY_MS.items():
        split = rep["phases"][variant]
        assert split["n"] == 20 and split["phases"]["gateway"]["label"] == "gateway"
        got = phases(rep, variant)
        assert got["gateway"] == pytest.approx(gateway) and got["schedule_lag"] == 0.0
        # the phases add up to the client's TTFT: the gateway's time, then the request's own clock
        assert sum(got.values()) == pytest.approx(gateway + 264.5)  # mean TTFT: 260 + 0..9
    assert list(rep["phases"]["fp16"]["phases"])[:3] == ["schedule_lag", "gateway", "connect"]


def test_the_rollup_of_a_live_run_splits_its_misses_as_the_raw_samples_do(store):
    store.insert_samples(live_rows(LIVE_RUN))
    store.record_run(LIVE_RUN, EXP, "live", "done", source="live")
    assert rollup.build_run_rollup(store, EXP, LIVE_RUN, SLO) is not None
    f = q.Filters(EXP, mode="live")
    fast, raw = r.build_report(store, info(), f), r.build_report(store, info(), f, use_rollup=False)
    assert fast["timing"]["source"] == "rollup" and raw["timing"]["source"] == "samples"
    for variant, gateway in GATEWAY_MS.items():
        assert phases(fast, variant) == pytest.approx(phases(raw, variant))
        assert phases(fast, variant)["gateway"] == pytest.approx(gateway)


def test_live_rows_recorded_before_gateway_ms_read_their_schedule_lag_as_the_gateway_s(store):
    # as the gateway recorded them before sample store migration 7: its time in schedule_lag_ms
    old = [
        sample_row(
            i,
            experiment=EXP,
            run_id=OLD_LIVE_RUN,
            mode="live",
            variant=("fp16", "awq")[i % 2],
            schedule_lag_ms=2.5,
            gateway_ms=0.0,
            outcome="ok",
            error="",
            http_status=200,
            ttft_ms=300.0,
        )
        for i in range(10)
    ]
    store.insert_samples(old)
    rep = r.build_report(store, info(), q.Filters(EXP, mode="live"))
    for variant in ("fp16", "awq"):
        got = phases(rep, variant)
        assert got["gateway"] == pytest.approx(2.5) and got["schedule_lag"] == 0.0


def test_a_replay_s_lateness_stays_its_schedule_lag_and_it_has_no_gateway_phase(store):
    rows = [
        row_from(
            result(i),
            SampleContext(
                experiment=EXP,
                run_id=REPLAY_RUN,
                seq=i,
                variant=("fp16", "awq")[i % 2],
                mode="split",
                sent_unix_ms=1_732_900_000_000.0 + i,
                user_id=f"u{i}",
                schedule_lag_ms=3.0,
            ),
        )
        for i in range(20)
    ]
    store.insert_samples(rows)
    store.record_run(REPLAY_RUN, EXP, "split", "done")
    rep = r.build_report(store, info(), q.Filters(EXP, mode="split"))
    for variant in ("fp16", "awq"):
        got = phases(rep, variant)
        assert got["schedule_lag"] == pytest.approx(3.0) and got["gateway"] == 0.0
