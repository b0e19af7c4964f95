"""What a capacity step judges at a look (analysis/step_counts.py ``settled_counts``), on the real
ClickHouse server: the settled prefix of the schedule, never the step's own cancellations, never
only the requests that happened to finish first."""

from __future__ import annotations

import pytest

from analysis.definitions import Slo
from analysis.step_counts import settled_counts
from capacity.search import MEETS, UNDECIDED, can_still_meet, step_verdict
from tests.samples.conftest import sample_row

RUN, VARIANT = 41, "awq-fa2"
SLO = Slo(ttft_ms=200.0)


def look(store, run_id: int, variant: str, order: list[int]) -> dict:
    """A look of a step of experiment ttft-opt whose SLO is a TTFT of 200 ms."""
    return settled_counts(store, SLO, experiment="ttft-opt", run_id=run_id, variant=variant, order=order)


def row(seq: int, outcome: str = "ok", ttft_ms: float | None = 50.0, **over) -> dict:
    return sample_row(
        seq,
        run_id=RUN,
        variant=VARIANT,
        mode="mirror",
        request_id=f"r{RUN}-{seq}-{VARIANT}",
        outcome=outcome,
        ttft_ms=ttft_ms,
        error="" if outcome == "ok" else outcome,
        output_tokens=8,
        **over,
    )


def test_the_steps_own_cancellations_are_not_judged_but_errors_and_timeouts_are_misses(ch_store):
    # 0-5 settled (two genuine failures among them), 6-9 cut short by the step's own stop
    ch_store.insert_samples(
        [
            row(0),
            row(1),
            row(2, "first_token_timeout", None),
            row(3),
            row(4, "http_5xx", None),
            row(5, ttft_ms=350.0),
        ]
        + [row(s, "cancelled", None) for s in range(6, 10)]
    )
    got = look(ch_store, RUN, VARIANT, list(range(10)))
    assert (got["n"], got["hits"], got["left"]) == (6, 3, 4)  # the old count: n 10, hits 3
    assert got["ttft_p50_ms"] == 50.0 and got["ttft_p99_ms"] == 350.0 and got["output_tokens_mean"] == 8.0


def test_setup_errors_are_left_out_of_the_verdict_and_counted_but_load_4xx_are_misses(ch_store):
    # 404 (wrong model) and 401 are the variant refusing the request as asked, as the report reads
    # them; 429 and 408 are load and stay misses
    ch_store.insert_samples(
        [
            row(0),
            row(1, "http_4xx", None, http_status=404),
            row(2, "http_4xx", None, http_status=401),
            row(3, "http_4xx", None, http_status=429),
            row(4, "http_4xx", None, http_status=408),
            row(5),
        ]
    )
    got = look(ch_store, RUN, VARIANT, list(range(6)))
    assert (got["n"], got["hits"], got["setup_errors"], got["left"]) == (4, 2, 2, 0)


def test_a_look_judges_only_the_prefix_of_the_schedule_that_has_settled(ch_store):
    # Request 3 is slow and still in flight at this look; 4-49 were sent after it and, fast,
    # have finished. Counting what arrived would say 49 hits of 49 and call it "meets" (target
    # 70%); the settled prefix is requests 0-2 only, and says nothing yet.
    ch_store.insert_samples([row(s) for s in range(50) if s != 3])
    order = list(range(50))
    got = look(ch_store, RUN, VARIANT, order)
    assert (got["n"], got["hits"], got["left"]) == (3, 3, 47)
    assert step_verdict(got["hits"], got["n"], 0.7, 0.05) == UNDECIDED
    assert step_verdict(49, 49, 0.7, 0.05) == MEETS  # what the old count concluded
    # the slow request lands, a miss: now every request is judged, and it counts
    ch_store.insert_samples([row(3, ttft_ms=900.0)])
    got = look(ch_store, RUN, VARIANT, order)
    assert (got["n"], got["hits"], got["left"]) == (50, 49, 0)


def test_the_prefix_follows_the_planned_send_order_and_the_latest_recording(ch_store):
    # planned order 5, 0, 1 (the schedule, not the seq numbers); request 0 recorded twice, the
    # later recording wins; request 2 is not judged (warm-up: not in the order)
    ch_store.insert_samples(
        [
            row(5),
            row(0, "total_timeout", None, recorded_ms=1_000),
            row(0, recorded_ms=2_000),
            row(2, ttft_ms=999.0),
        ]
    )
    got = look(ch_store, RUN, VARIANT, [5, 0, 1])
    assert (got["n"], got["hits"], got["left"]) == (2, 2, 1)
    assert look(ch_store, RUN, "fp16", [5, 0, 1])["n"] == 0  # another variant's rows: none


def test_the_steps_lag_is_the_p99_over_the_requests_it_judged(ch_store):
    # A spike in the warm-up (requests 100-104, not judged: not in the order) and after the
    # first request still in flight (51-59) is not the lag of the requests the verdict rests on
    warm = [row(s, schedule_lag_ms=900.0) for s in range(100, 105)]
    judged = [row(s, schedule_lag_ms=s / 10) for s in range(50)]
    late = [row(s, schedule_lag_ms=80.0) for s in range(51, 60)]
    ch_store.insert_samples(warm + judged + late)
    order = list(range(60))
    got = look(ch_store, RUN, VARIANT, order)
    assert got["n"] == 50 and got["lag_p99_ms"] == pytest.approx(4.9)  # nearest rank: the 50th of 50
    # request 50 lands: now 51-59 are judged too, and their lag counts
    ch_store.insert_samples([row(50, schedule_lag_ms=2.0)])
    got = look(ch_store, RUN, VARIANT, order)
    assert got["n"] == 60 and got["lag_p99_ms"] == 80.0
    assert look(ch_store, RUN, VARIANT, [200, 201])["lag_p99_ms"] is None  # nothing judged


@pytest.mark.parametrize(
    "hits, n, left, can",
    [
        (0, 0, 2000, True),
        (0, 0, 663, True),
        (0, 0, 662, False),
        (10, 10, 653, True),
        (199, 200, 798, True),
        (199, 200, 797, False),
        (198, 200, 1075, True),
        (198, 200, 1074, False),
        (500, 600, 10, False),
    ],
)
def test_a_step_that_can_no_longer_meet_before_its_cap_is_futile(hits, n, left, can):
    # at 99.2% and alpha 0.025 a step meets with no miss in 663 requests, with one in 998, with
    # two in 1,275 (capacity.search.step_sequence)
    assert can_still_meet(hits, n, left, 0.992, 0.025) is can
