"""A replay started in a background thread, and waiting for what it does meanwhile; the demo
experiment installed for worker and `manage.py` subprocesses, and reading what they did."""

import datetime as dt
import io
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from django.core.management import call_command
from django.db import connections

from samples.backends.clickhouse import ClickHouseServerBackend
from tests.plugin import TEST_SECRET_KEY

TRACE = "data/traces/azure_llm_2023_code.csv"
# What of an ABPLAT_VAR install_demo copies: the Django database (a SQLite file: settings) and the
# published traffic weights (experiments.weights, WEIGHTS_DIR) of the started experiment.
DATABASE_FILE = "abplat.sqlite3"
WEIGHTS = "weights"


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


def wait_for(predicate, timeout: float = 60.0, poll: float = 0.05, message=None) -> None:
    """Poll ``predicate`` until it is true; a failed assertion after ``timeout`` seconds, saying
    ``message()`` when given (a worker's log, say)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message() if message else "timed out"
        time.sleep(poll)


ROOT = Path(__file__).resolve().parents[2]


def subprocess_env(**settings: str) -> dict:
    """The environment of a `manage.py` or worker process: this one's without any ABPLAT_*
    setting but the session's test secret key (settings refuse to start with DEBUG off and no
    key), plus ``settings``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    return {**base, "ABPLAT_SECRET_KEY": TEST_SECRET_KEY, **settings}


def manage(env: dict, *args: str, **kw) -> str:
    """`python manage.py *args` in a subprocess with ``env``; its stdout, or a failed assertion.

    ``env`` gets the session's test secret key unless it names one or turns debug on: settings
    refuse to start with DEBUG off and no key. In place, so the worker and replay processes a
    test starts later with the same ``env`` get it too."""
    if "ABPLAT_SECRET_KEY" not in env and "ABPLAT_DEBUG" not in env:
        env["ABPLAT_SECRET_KEY"] = TEST_SECRET_KEY
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


class Standby:
    """`manage.py shell -c CODE` started now and run on ``go()``: Django starts up (seconds on a
    busy machine) while the test waits for the moment, and CODE then runs at once."""

    def __init__(self, env: dict, code: str) -> None:
        if "ABPLAT_SECRET_KEY" not in env and "ABPLAT_DEBUG" not in env:
            env["ABPLAT_SECRET_KEY"] = TEST_SECRET_KEY
        script = f"import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n{code}"
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "shell", "-c", script],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def go(self) -> str:
        """Run CODE once Django is ready; its stdout, or a failed assertion."""
        seen = []
        while (line := self.proc.stdout.readline()) not in ("ready\n", ""):
            seen.append(line)  # what the shell says first (the models it imported)
        if not line:  # it ended before it was ready
            out, err = self.proc.communicate()
            raise AssertionError("".join(seen) + out + err)
        out, err = self.proc.communicate("go\n", timeout=120)
        assert self.proc.returncode == 0, err + out
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def _apply_demo(env: dict, directory: Path, sims, *migrate_args: str) -> None:
    """In one `manage.py` process with ``env``: migrate (``migrate_args``), apply the demo
    experiment with its variants on ``sims`` (simulator handles, in the document's order; the
    document is written to ``directory``) and start it."""
    doc = yaml.safe_load((ROOT / "demo" / "ttft-optimizations.yaml").read_text())
    for variant, sim in zip(doc["variants"], sims, strict=True):
        variant["endpoint"] = sim.url + "/v1"
    path = directory / "exp.yaml"
    path.write_text(yaml.safe_dump(doc))
    manage(
        env,
        "shell",
        "-c",
        (
            "from django.core.management import call_command; from experiments import services; "
            "from experiments.models import Experiment; "
            f"call_command('migrate', *{list(migrate_args)!r}, verbosity=0); "
            f"call_command('apply_experiment', {str(path)!r}); "
            "services.transition(Experiment.objects.get(), 'start')"
        ),
    )


def start_demo_experiment(env: dict, tmp_path: Path, sims) -> None:
    """In the database and sample store ``env`` names: migrate both, apply the demo experiment
    with its variants on ``sims`` (simulator handles, in the document's order) and start it."""
    _apply_demo(env, tmp_path, sims)


def make_demo_template(var: Path, sims) -> None:
    """In ``var`` (an ABPLAT_VAR): the Django database migrated and the demo experiment applied
    with its variants on ``sims`` and started, once, for the tests that copy it (install_demo).
    The sample store is not touched: each test has its own ClickHouse database."""
    _apply_demo(subprocess_env(ABPLAT_VAR=str(var)), var, sims, "--skip-sample-store")
    assert (var / DATABASE_FILE).is_file() and (var / WEIGHTS).is_dir(), sorted(os.listdir(var))


def install_demo(env: dict, template: Path) -> None:
    """The demo experiment, running (make_demo_template), in the database and sample store
    ``env`` names: the template's database and weights copied into its ABPLAT_VAR, its
    ClickHouse database created and migrated."""
    var = Path(env["ABPLAT_VAR"])
    shutil.copyfile(template / DATABASE_FILE, var / DATABASE_FILE)
    shutil.copytree(template / WEIGHTS, var / WEIGHTS)
    ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).migrate()


def db_rows(env: dict, sql: str, *params) -> list[tuple]:
    """Rows of a read-only query on the SQLite database of ``env``'s processes (a test's own
    Django is on its test database; a `manage.py shell` costs a Django start-up per look)."""
    uri = f"file:{Path(env['ABPLAT_VAR']) / DATABASE_FILE}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=30)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def db_time(value: str | None) -> dt.datetime | None:
    """A datetime column as Django writes it to SQLite (UTC, naive), aware."""
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.UTC) if value else None


def run_status(env: dict) -> str:
    """The status of the one replay run in ``env``'s database ("" before there is one)."""
    rows = db_rows(env, "SELECT status FROM workers_replayrun")
    assert len(rows) <= 1, rows
    return rows[0][0] if rows else ""


FINAL = ("done", "failed", "cancelled")


def wait_final(env: dict, log: Path | None = None, timeout: float = 150.0) -> str:
    """The run's final status, once it has one."""
    wait_for(
        lambda: run_status(env) in FINAL,
        timeout,
        poll=0.2,
        message=lambda: log.read_text()[-3000:] if log else run_status(env),
    )
    return run_status(env)


def store_count(env: dict) -> int:
    """Samples in ``env``'s ClickHouse database (0 before its tables exist)."""
    try:
        return int(
            ClickHouseServerBackend(env["ABPLAT_CLICKHOUSE_URL"]).query("SELECT count() FROM samples")[0][0]
        )
    except Exception:
        return 0


def start_worker(env, log: Path, pool: str = "prefork") -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "abplat",
            "worker",
            "--pool",
            pool,
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
            "-n",
            f"w{time.monotonic_ns()}@%h",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_all(workers, sims=()) -> None:
    """A test's teardown: each worker still running gets SIGTERM (its whole process group, a
    warm shutdown) and 30 s; then the simulators stop."""
    for w in workers:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGTERM)
            w.wait(30)
    for s in sims:
        s.stop()
