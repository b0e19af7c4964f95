"""Interrupting `manage.py replay` for real (issue 16, bug 3): a subprocess on eager Celery
gets SIGINT (Ctrl-C) or SIGTERM mid-run and cancels the run cleanly (nothing sent after,
counters equal to the store); one killed outright is found by the lease and ended by
flush_samples with exact counts."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from samples.backends.clickhouse import ClickHouseServerBackend
from simulator.serve import start_in_thread
from tests.plugin import server_url_for
from tests.workers.background import ROOT, manage, start_demo_experiment
from workers.tasks import lease_s


@pytest.fixture
def env(tmp_path, clickhouse_server):
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    url = server_url_for(database, clickhouse_server)
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    env = {**base, "ABPLAT_VAR": str(tmp_path), "ABPLAT_CLICKHOUSE_URL": url, "ABPLAT_LOG_LEVEL": "WARNING"}
    start_demo_experiment(env, tmp_path, sims)
    yield env
    for s in sims:
        s.stop()
    ClickHouseServerBackend(url).execute(f"DROP DATABASE IF EXISTS {database}")


def store_count(env) -> int:
    try:
        return int(
            ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).query("SELECT count() FROM samples")[0][0]
        )
    except Exception:
        return 0


def run_state(env) -> dict:
    out = manage(env, "shell", "-c", (
        "import json; from workers.models import ReplayRun; r = ReplayRun.objects.get(); "
        "s = list(r.shards.values('sent', 'recorded', 'status')); "
        "print(json.dumps({'status': r.status, 'recorded': r.samples_recorded, 'error': r.error, "
        "'sent_shards': sum(x['sent'] for x in s), 'recorded_shards': sum(x['recorded'] for x in s), "
        "'shard_status': [x['status'] for x in s], 'outcomes': r.outcomes}))"
    ))  # fmt: skip
    import json

    return json.loads(out.strip().splitlines()[-1])


def start_replay(env, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "replay", "ttft-optimizations", "--trace",
         "data/traces/azure_llm_2023_code.csv", "--limit", "200", "--speed", "4"],  # ~50 s of schedule
        cwd=ROOT, env=env, stdout=(tmp_path / "out.txt").open("w"), stderr=(tmp_path / "err.txt").open("w"),
    )  # fmt: skip


def wait_recorded(env, proc, tmp_path, n=15):
    deadline = time.monotonic() + 90
    while store_count(env) < n:
        assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cancels_the_replay_cleanly(env, tmp_path, signum):
    proc = start_replay(env, tmp_path)
    try:
        wait_recorded(env, proc, tmp_path)
        proc.send_signal(signum)
        code = proc.wait(60)
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
    assert state["recorded"] == stored == state["recorded_shards"] == state["sent_shards"] < 200, state
    time.sleep(1.5)
    assert store_count(env) == stored  # nothing is sent after the process ended
    catalog = ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).query(
        "SELECT argMax(status, version) FROM runs GROUP BY run_id"
    )
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
    # A heartbeat stamped now stands for an owner that may still be alive (two Django start-ups
    # on a loaded CI machine can outlast the killed process' last real heartbeat's lease).
    manage(env, "shell", "-c", (
        "from django.utils import timezone; from workers.models import ReplayShard; "
        "ReplayShard.objects.update(heartbeat_at=timezone.now())"
    ))  # fmt: skip
    out = manage(env, "flush_samples")
    assert "owner lost" not in out  # the lease has not expired yet: the owner may be alive
    time.sleep(lease_s() + 1)
    out = manage(env, "flush_samples")
    state = run_state(env)
    assert "owner lost, failed" in out, out
    assert state["status"] == "failed" and "abandoned" in state["error"], state
    assert state["recorded"] == store_count(env) == state["recorded_shards"] and state["shard_status"] == [
        "failed"
    ]
