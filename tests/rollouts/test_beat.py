"""The controller on real Celery: two beat processes and two workers on Redis, the weights in
real etcd. Each interval brings decisions, and never two within one interval."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import yaml

from tests.rollouts.conftest import ROLLOUT_DOCUMENT
from tests.split.conftest import TEST_ETCD
from tests.workers.background import ROOT, db_rows, manage, start_worker, stop_all, wait_for

INTERVAL_S = 2


def start_beat(env: dict, tmp_path, n: int) -> subprocess.Popen:
    log = tmp_path / f"beat{n}.log"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "abplat",
            "beat",
            "-l",
            "INFO",
            "-s",
            str(tmp_path / f"beat{n}-schedule"),
            "--pidfile",
            str(tmp_path / f"beat{n}.pid"),
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def decisions(env: dict) -> list[tuple[str, float]]:
    """The rollout's audit entries (action, the database-clock end of the lease its look
    claimed), oldest first: read from the processes' SQLite file, polled while the beats run (a
    `manage.py shell` per poll would start Django)."""
    rows = db_rows(
        env, "SELECT action, after FROM experiments_auditentry WHERE action LIKE 'rollout_%' ORDER BY at, id"
    )
    return [(action, json.loads(after)["lease_until_s"]) for action, after in rows]


def test_beat_decides_once_per_interval_however_many_beats_and_workers(broker_env, tmp_path):
    env = {
        **broker_env,
        "ABPLAT_ROLLOUT_INTERVAL_S": str(INTERVAL_S),
        "ABPLAT_ETCD_ENDPOINTS": TEST_ETCD,
        "ABPLAT_ETCD_PREFIX": f"/abplat-test/{uuid.uuid4().hex}/",
    }
    doc = json.loads(json.dumps(ROLLOUT_DOCUMENT))
    doc["rollout"]["min_samples"] = 1_000_000  # no traffic: start, then hold every interval
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    # The processes' database, sample store and experiment, running: the same commands in one
    # Django start-up.
    manage(
        env,
        "shell",
        "-c",
        "from django.core.management import call_command as c; "
        "c('migrate', verbosity=0); c('clickhouse_migrate'); "
        f"c('apply_experiment', {str(tmp_path / 'exp.yaml')!r}); "
        "from experiments import services; from experiments.models import Experiment; "
        "services.transition(Experiment.objects.get(), 'start')",
    )
    procs = [start_worker(env, tmp_path / f"worker{i}.log") for i in range(2)]
    procs += [start_beat(env, tmp_path, i) for i in range(2)]
    try:
        wait_for(lambda: len(decisions(env)) >= 5, timeout=120, poll=0.2)
    finally:
        stop_all(procs, [])
    got = decisions(env)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert got[0][0] == "rollout_start" and {a for a, _ in got[1:]} == {"rollout_hold"}, (got, logs[-3000:])
    claims = [until for _, until in got]
    gaps = [b - a for a, b in zip(claims, claims[1:], strict=False)]
    # Two beats send two ticks per interval; the lease (0.9 interval on the database clock) lets
    # one of them decide. Each entry carries the lease its look claimed, so consecutive claims are
    # at least the lease apart whatever the look's own work took; ticks of two beats decided
    # twice would be anywhere from 0 to one interval apart.
    assert min(gaps) >= 0.9 * INTERVAL_S, (gaps, logs[-3000:])
    assert "not due" in logs, logs[-3000:]
