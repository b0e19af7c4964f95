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
from tests.workers.background import ROOT, db_rows, db_time, manage, start_worker, stop_all, wait_for

INTERVAL_S = 2


def start_beat(env: dict, tmp_path, n: int) -> subprocess.Popen:
    log = tmp_path / f"beat{n}.log"
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "abplat", "beat", "-l", "INFO",
         "-s", str(tmp_path / f"beat{n}-schedule"), "--pidfile", str(tmp_path / f"beat{n}.pid")],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def decisions(env: dict) -> list[tuple[str, float]]:
    """The rollout's audit entries (action, unix time), oldest first: read from the processes'
    SQLite file, polled while the beats run (a `manage.py shell` per poll would start Django)."""
    rows = db_rows(env, "SELECT action, at FROM experiments_auditentry WHERE action LIKE 'rollout_%' "
                   "ORDER BY at, id")  # fmt: skip
    return [(action, db_time(at).timestamp()) for action, at in rows]


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
    manage(env, "shell", "-c", "from django.core.management import call_command as c; "
           "c('migrate', verbosity=0); c('clickhouse_migrate'); "
           f"c('apply_experiment', {str(tmp_path / 'exp.yaml')!r}); "
           "from experiments import services; from experiments.models import Experiment; "
           "services.transition(Experiment.objects.get(), 'start')")  # fmt: skip
    procs = [start_worker(env, tmp_path / f"worker{i}.log") for i in range(2)]
    procs += [start_beat(env, tmp_path, i) for i in range(2)]
    try:
        wait_for(lambda: len(decisions(env)) >= 5, timeout=120, poll=0.2)
    finally:
        stop_all(procs, [])
    got = decisions(env)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert got[0][0] == "rollout_start" and {a for a, _ in got[1:]} == {"rollout_hold"}, (got, logs[-3000:])
    gaps = [b - a for (_, a), (_, b) in zip(got, got[1:], strict=False)]
    # Two beats send two ticks per interval; the lease (0.9 interval on the database clock) lets
    # one of them decide. The audit times lag the claims by a look's own work (a few ms to a
    # few hundred on a loaded machine), hence the margin; ticks of two beats decided twice would
    # be anywhere from 0 to one interval apart.
    assert min(gaps) >= 0.9 * INTERVAL_S - 0.3, (gaps, logs[-3000:])
    assert "not due" in logs, logs[-3000:]
