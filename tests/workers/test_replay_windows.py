"""Bounded shard tasks on a real broker: a schedule several Celery time limits long replays
through real workers on Redis, one (window, slot) task at a time, with exact counts; a run
cancelled between windows ends without sending the windows that had not opened."""

import pytest

from samples.backends.clickhouse import ClickHouseServerBackend
from tests.workers.background import (
    Standby,
    db_rows,
    db_time,
    manage,
    start_worker,
    stop_all,
    store_count,
    wait_final,
    wait_for,
)

pytestmark = [pytest.mark.services]

SOFT_LIMIT_S = 8  # the task time limit, shortened: the schedule below lasts three of them
WINDOW_S = 3


def query(env, sql: str) -> list:
    return ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).query(sql)


def run_fields(env, *fields: str) -> tuple:
    (row,) = db_rows(env, f"SELECT {', '.join(fields)} FROM workers_replayrun")
    return row


def shard_table(env) -> list[tuple]:
    """(window, slot, status, planned, sent, recorded, attempts, seconds it ran) per shard."""
    rows = db_rows(
        env,
        'SELECT "window", slot, status, planned, sent, recorded, attempts, started_at, finished_at '
        'FROM workers_replayshard ORDER BY "index"',
    )
    return [
        (*row[:7], (db_time(row[8]) - db_time(row[7])).total_seconds() if row[7] and row[8] else None)
        for row in rows
    ]


@pytest.fixture
def windowed(demo_env):
    return {
        **demo_env,
        "ABPLAT_TASK_SOFT_TIME_LIMIT_S": str(SOFT_LIMIT_S),
        "ABPLAT_REPLAY_WINDOW_S": str(WINDOW_S),
        "ABPLAT_VISIBILITY_TIMEOUT": "60",
    }


def test_schedule_several_time_limits_long_replays_window_by_window_with_exact_counts(windowed, tmp_path):
    env = windowed
    log = tmp_path / "worker.log"
    workers = []
    try:
        workers = [start_worker(env, log), start_worker(env, log)]
        # 480 requests at 20/s (Poisson, its seed fixed): 24 s of schedule, three soft limits.
        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "480",
            "--arrival",
            "poisson",
            "--rate",
            "20",
            "--shards",
            "2",
        )
        assert wait_final(env, log, 180) == "done", log.read_text()[-3000:]
        assert run_fields(env, "expected_samples", "samples_recorded") == (480, 480)
        per_seq = dict(query(env, "SELECT seq, count() FROM samples GROUP BY seq"))
        assert sorted(per_seq) == list(range(480)) and set(per_seq.values()) == {1}
        shards = shard_table(env)
        windows = {s[0] for s in shards}
        assert len(windows) >= 8, shards  # 24 s in 3 s windows: one task per window and slot
        assert {s[2] for s in shards} == {"done"}
        assert sum(s[3] for s in shards) == 480 and sum(s[5] for s in shards) == 480
        # Each task lasted about its window (plus the lead and the last requests in flight),
        # inside the shortened soft limit: none was killed or retried.
        for w, slot, _st, _p, _s, _r, attempts, seconds in shards:
            assert attempts == 1, shards
            assert seconds < SOFT_LIMIT_S, (w, slot, shards)
        # No gap and no burst at the seams: every request went out on its schedule.
        lags = [r[0] for r in query(env, "SELECT schedule_lag_ms FROM samples ORDER BY schedule_lag_ms")]
        assert lags[len(lags) // 2] < 100 and lags[int(0.99 * (len(lags) - 1))] < 1000, lags[-20:]
        assert "SoftTimeLimitExceeded" not in log.read_text()
    finally:
        stop_all(workers)


def test_cancel_between_windows_ends_the_run_without_the_windows_not_yet_open(windowed, tmp_path):
    env = windowed
    log = tmp_path / "worker.log"
    workers = []
    # Django starts while the replay runs; the cancel then lands the moment it is asked for.
    cancel = Standby(
        env,
        "from workers.models import ReplayRun; from workers.runs import cancel_run; "
        "cancel_run(ReplayRun.objects.get())",
    )
    try:
        workers = [start_worker(env, log)]
        # 360 requests at 30/s (Poisson): four 3 s windows of about 90. The cancel lands in the
        # second while it sends; the last two have not opened.
        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "360",
            "--arrival",
            "poisson",
            "--rate",
            "30",
            "--shards",
            "1",
        )
        wait_for(lambda: store_count(env) >= 100, 90, poll=0.1, message=lambda: log.read_text()[-3000:])
        cancel.go()
        assert wait_final(env, log, 60) == "cancelled", log.read_text()[-3000:]
        (recorded,) = run_fields(env, "samples_recorded")
        stored = query(env, "SELECT count(), uniqExact(seq) FROM samples")[0]
        assert recorded == stored[0] == stored[1] < 360  # exact, and the rest never sent
        shards = shard_table(env)
        assert {s[2] for s in shards} == {"done"}
        assert any(s[4] == 0 for s in shards), shards  # later windows ended without sending
    finally:
        cancel.close()
        stop_all(workers)
