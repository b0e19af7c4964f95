"""Interrupting `manage.py replay` for real: a subprocess on eager Celery
gets SIGINT (Ctrl-C) or SIGTERM mid-run and cancels the run cleanly (nothing sent after,
counters equal to the store); one killed outright is found by the lease and ended by
flush_samples with exact counts."""

import datetime as dt
import json
import signal
import subprocess
import sys
import time

import pytest

from samples.backends.clickhouse import ClickHouseServerBackend
from tests.workers.background import (
    ROOT,
    db_rows,
    db_time,
    install_demo,
    manage,
    store_count,
    subprocess_env,
    wait_for,
)


@pytest.fixture
def env(tmp_path, clickhouse_database, demo_template):
    env = subprocess_env(
        ABPLAT_VAR=str(tmp_path), ABPLAT_CLICKHOUSE_URL=clickhouse_database, ABPLAT_LOG_LEVEL="WARNING"
    )
    install_demo(env, demo_template)
    return env


def run_state(env) -> dict:
    ((run_id, status, recorded, error, outcomes),) = db_rows(
        env, "SELECT id, status, samples_recorded, error, outcomes FROM workers_replayrun"
    )
    shards = db_rows(env, "SELECT sent, recorded, status FROM workers_replayshard WHERE run_id = ?", run_id)
    return {
        "status": status,
        "recorded": recorded,
        "error": error,
        "outcomes": json.loads(outcomes),
        "sent_shards": sum(s[0] for s in shards),
        "recorded_shards": sum(s[1] for s in shards),
        "shard_status": [s[2] for s in shards],
    }


def start_replay(env, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "replay",
            "ttft-optimizations",
            "--trace",
            "data/traces/azure_llm_2023_code.csv",
            "--limit",
            "100",
            "--speed",
            "10",
        ],  # ~19 s of schedule
        cwd=ROOT,
        env=env,
        stdout=(tmp_path / "out.txt").open("w"),
        stderr=(tmp_path / "err.txt").open("w"),
    )


def wait_recorded(env, proc, tmp_path, n=15):
    """Until the replay has stored ``n`` samples: mid-run (63 requests go out in the first 4 s,
    the last 37 at 18-19 s)."""

    def err() -> str:
        return (tmp_path / "err.txt").read_text()[-3000:]

    def recorded() -> bool:
        assert proc.poll() is None, err()
        return store_count(env) >= n

    wait_for(recorded, timeout=90, poll=0.1, message=err)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cancels_the_replay_cleanly(env, tmp_path, signum):
    proc = start_replay(env, tmp_path)
    try:
        wait_recorded(env, proc, tmp_path)
        proc.send_signal(signum)
        code = proc.wait(60)
        ended_ms = time.time() * 1000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "err.txt").read_text()
    assert code == 1 and f"{signal.Signals(signum).name}: cancelling run" in err, err[-3000:]
    assert f"ended cancelled ({signal.Signals(signum).name})" in err
    assert "cannot schedule new futures" not in err and "Traceback" not in err, err[-3000:]
    stored = store_count(env)
    state = run_state(env)
    assert state["status"] == "cancelled", state
    assert state["recorded"] == stored == state["recorded_shards"] == state["sent_shards"] < 100, state
    # Nothing is sent after the process ended: every sample stored was sent before it did, and
    # the store still holds exactly those.
    store = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"])
    assert store.query("SELECT max(sent_unix_ms) FROM samples")[0][0] <= ended_ms
    assert store_count(env) == stored
    catalog = store.query("SELECT argMax(status, version) FROM runs GROUP BY run_id")
    assert [r[0] for r in catalog] == ["cancelled"]


def test_a_killed_replay_is_found_by_its_lease_and_ended_with_exact_counts(env, tmp_path):
    proc = start_replay(env, tmp_path)
    try:
        wait_recorded(env, proc, tmp_path)
        proc.kill()  # no handler runs: the run is left `running`
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run_state(env)["status"] == "running"
    # The lease runs from the killed process' last real heartbeat. Under an hour's lease the
    # owner may still be alive: the run is left alone.
    out = manage({**env, "ABPLAT_REPLAY_LEASE_S": "3600"}, "flush_samples")
    assert "owner lost" not in out
    # Under a 2 s lease it has expired once that heartbeat is over 2 s old. A Django start-up
    # usually takes that long already; on a fast host the rest (at most 2 s) is waited out here,
    # since the lease is read against the database's clock in another process.
    ((beat,),) = db_rows(
        env,
        "SELECT coalesce(max(s.heartbeat_at), r.started_at) FROM workers_replayshard s "
        "JOIN workers_replayrun r ON r.id = s.run_id",
    )
    expired_at = db_time(beat) + dt.timedelta(seconds=2.2)
    time.sleep(max(0.0, (expired_at - dt.datetime.now(dt.UTC)).total_seconds()))
    assert db_time(beat) < dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
    out = manage({**env, "ABPLAT_REPLAY_LEASE_S": "2"}, "flush_samples")
    state = run_state(env)
    assert "owner lost, failed" in out, out
    assert (
        state["status"] == "failed" and "abandoned" in state["error"] and "(lease 2 s)" in state["error"]
    ), state
    assert state["recorded"] == store_count(env) == state["recorded_shards"] and state["shard_status"] == [
        "failed"
    ]
