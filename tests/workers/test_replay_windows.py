"""Bounded shard tasks on a real broker: a schedule several Celery time limits long replays
through real workers on Redis, one (window, slot) task at a time, with exact counts; a run
cancelled between windows ends without sending the windows that had not opened."""

import time

import pytest

from samples.backends.clickhouse import ClickHouseServerBackend
from simulator.serve import start_in_thread
from tests.workers.background import manage, start_demo_experiment, start_worker, stop_all

pytestmark = [pytest.mark.services]

SOFT_LIMIT_S = 8  # the task time limit, shortened: the schedule below lasts five of them
WINDOW_S = 3


def query(env, sql: str) -> list:
    return ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).query(sql)


def run_fields(env, *fields: str) -> list[str]:
    code = (
        "from workers.models import ReplayRun; r = ReplayRun.objects.get(); "
        f"print('|'.join(str(getattr(r, f)) for f in {list(fields)!r}))"
    )
    return manage(env, "shell", "-c", code).strip().splitlines()[-1].split("|")


def shard_table(env) -> list[tuple]:
    code = (
        "from workers.models import ReplayShard\n"
        "for s in ReplayShard.objects.order_by('index'):\n"
        "    print('shard', s.window, s.slot, s.status, s.planned, s.sent, s.recorded, s.attempts,"
        " int(s.started_at.timestamp() * 1000) if s.started_at else 0,"
        " int(s.finished_at.timestamp() * 1000) if s.finished_at else 0)"
    )
    out = manage(env, "shell", "-c", code).strip().splitlines()
    return [tuple(line.split()[1:]) for line in out if line.startswith("shard ")]


def wait_final(env, log, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := run_fields(env, "status")[0]) not in ("done", "failed", "cancelled"):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)
    return status


@pytest.fixture
def windowed(broker_env):
    return {**broker_env, "ABPLAT_TASK_SOFT_TIME_LIMIT_S": str(SOFT_LIMIT_S), "ABPLAT_REPLAY_WINDOW_S": str(WINDOW_S),
            "ABPLAT_VISIBILITY_TIMEOUT": "60"}  # fmt: skip


def test_schedule_several_time_limits_long_replays_window_by_window_with_exact_counts(windowed, tmp_path):
    env = windowed
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    log = tmp_path / "worker.log"
    workers = []
    try:
        start_demo_experiment(env, tmp_path, sims)
        workers = [start_worker(env, log), start_worker(env, log)]
        # 800 requests at 20/s (Poisson): 40 s of schedule, five soft limits.
        manage(env, "replay", "ttft-optimizations", "--trace", "data/traces/azure_llm_2023_code.csv",
               "--limit", "800", "--arrival", "poisson", "--rate", "20", "--shards", "2")  # fmt: skip
        assert wait_final(env, log, 180) == "done", log.read_text()[-3000:]
        status, expected, recorded = run_fields(env, "status", "expected_samples", "samples_recorded")
        assert (expected, recorded) == ("800", "800")
        per_seq = dict(query(env, "SELECT seq, count() FROM samples GROUP BY seq"))
        assert sorted(per_seq) == list(range(800)) and set(per_seq.values()) == {1}
        shards = shard_table(env)
        windows = {int(s[0]) for s in shards}
        assert len(windows) >= 13, shards  # 40 s in 3 s windows: one task per window and slot
        assert {s[2] for s in shards} == {"done"}
        assert sum(int(s[3]) for s in shards) == 800 and sum(int(s[5]) for s in shards) == 800
        # Each task lasted about its window (plus the lead and the last requests in flight),
        # inside the shortened soft limit: none was killed or retried.
        for w, slot, _st, _p, _s, _r, attempts, started, finished in shards:
            assert attempts == "1", shards
            assert (int(finished) - int(started)) / 1000 < SOFT_LIMIT_S, (w, slot, shards)
        # No gap and no burst at the seams: every request went out on its schedule.
        lags = [r[0] for r in query(env, "SELECT schedule_lag_ms FROM samples ORDER BY schedule_lag_ms")]
        assert lags[len(lags) // 2] < 100 and lags[int(0.99 * (len(lags) - 1))] < 1000, lags[-20:]
        assert "SoftTimeLimitExceeded" not in log.read_text()
    finally:
        stop_all(workers, sims)


def test_cancel_between_windows_ends_the_run_without_the_windows_not_yet_open(windowed, tmp_path):
    env = windowed
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    log = tmp_path / "worker.log"
    workers = []
    try:
        start_demo_experiment(env, tmp_path, sims)
        workers = [start_worker(env, log)]
        manage(env, "replay", "ttft-optimizations", "--trace", "data/traces/azure_llm_2023_code.csv",
               "--limit", "800", "--speed", "20", "--shards", "1")  # fmt: skip
        deadline = time.monotonic() + 60
        while not query(env, "SELECT count() FROM samples")[0][0] >= 100:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        manage(env, "shell", "-c", "from workers.models import ReplayRun; from workers.runs import cancel_run; "
               "cancel_run(ReplayRun.objects.get())")  # fmt: skip
        assert wait_final(env, log, 60) == "cancelled", log.read_text()[-3000:]
        _status, recorded = run_fields(env, "status", "samples_recorded")
        stored = query(env, "SELECT count(), uniqExact(seq) FROM samples")[0]
        assert int(recorded) == stored[0] == stored[1] < 800  # exact, and the rest never sent
        shards = shard_table(env)
        assert {s[2] for s in shards} == {"done"}
        assert any(s[4] == "0" for s in shards), shards  # later windows ended without sending
    finally:
        stop_all(workers, sims)
