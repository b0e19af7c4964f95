"""A replay started in a background thread, and waiting for what it does meanwhile."""

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from django.core.management import call_command
from django.db import connections

from tests.plugin import TEST_SECRET_KEY

TRACE = "data/traces/azure_llm_2023_code.csv"


def replay_in_thread(*args, key: str = "ttft-opt", trace: str = TRACE):
    """`manage.py replay KEY --trace TRACE *args` in a thread: (thread, its stdout, its errors)."""
    out, errors = io.StringIO(), []

    def work():
        try:
            call_command("replay", key, "--trace", trace, *args, stdout=out)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()  # this thread's connections, before the test database goes

    thread = threading.Thread(target=work)
    thread.start()
    return thread, out, errors


def wait_for(predicate, timeout: float = 60.0, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


ROOT = Path(__file__).resolve().parents[2]


def manage(env: dict, *args: str, **kw) -> str:
    """`python manage.py *args` in a subprocess with ``env``; its stdout, or a failed assertion.

    ``env`` gets the session's test secret key unless it names one or turns debug on: settings
    refuse to start with DEBUG off and no key. In place, so the worker and replay processes a
    test starts later with the same ``env`` get it too."""
    if "ABPLAT_SECRET_KEY" not in env and "ABPLAT_DEBUG" not in env:
        env["ABPLAT_SECRET_KEY"] = TEST_SECRET_KEY
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, **kw)  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def start_demo_experiment(env: dict, tmp_path: Path, sims) -> None:
    """In the database and sample store ``env`` names: migrate both, apply the demo experiment
    with its variants on ``sims`` (simulator handles, in the document's order) and start it."""
    manage(env, "migrate", "-v0")
    manage(env, "clickhouse_migrate")
    doc = yaml.safe_load((ROOT / "demo" / "ttft-optimizations.yaml").read_text())
    for variant, sim in zip(doc["variants"], sims):
        variant["endpoint"] = sim.url + "/v1"
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    manage(env, "apply_experiment", str(tmp_path / "exp.yaml"))
    manage(env, "shell", "-c", "from experiments import services; from experiments.models import Experiment; "
           "services.transition(Experiment.objects.get(), 'start')")  # fmt: skip


def start_worker(env, log: Path, pool: str = "prefork") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "abplat", "worker", "--pool", pool, "-c", "2",
         "--without-gossip", "--without-mingle", "-l", "INFO", "-n", f"w{time.monotonic_ns()}@%h"],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def stop_all(workers, sims) -> None:
    """A test's teardown: each worker still running gets SIGTERM (its whole process group, a
    warm shutdown) and 30 s; then the simulators stop."""
    for w in workers:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGTERM)
            w.wait(30)
    for s in sims:
        s.stop()
