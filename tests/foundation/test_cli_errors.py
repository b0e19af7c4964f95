"""What a person sees when a command refuses or fails in a way it knows: one line on stderr,
``abplat: <what>: <what to do>``, no class name, no traceback (experiments.cli, Command). Each
command runs in this process as typed on a terminal (tests.cli.as_typed)."""

from __future__ import annotations

import copy
import fcntl
import io

import pytest
import yaml
from django.core.management import call_command

from experiments import services
from experiments.engine_args import check_engine_args
from tests.cli import as_typed, failing
from tests.workers.background import TRACE
from workers.models import ReplayRun

TYPO = "ttft-optimisations"
MEANT = "ttft-optimizations"
DID_YOU_MEAN = f"no experiment {TYPO!r}; did you mean {MEANT!r}?"


def one_line(stderr: str) -> str:
    """The single line a failure printed, checked to be one abplat line without a class name."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("abplat: ") and "Error:" not in lines[0] and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture
def meant(db, document, users):
    """An experiment whose key is the one the typo misspells, started (weights published)."""
    doc = copy.deepcopy(document)
    doc["key"] = MEANT
    experiment = services.apply_document(doc, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment


@pytest.mark.parametrize(
    "argv",
    [
        ("assign", TYPO),
        ("experiment", "show", TYPO),
        ("experiment", "pause", TYPO),
        ("export_experiment", TYPO),
        ("set_weights", TYPO, "fp16=100", "--reason", "typo"),
        ("replay", TYPO, "--trace", TRACE),
        ("sla_report", TYPO),
        ("rollout", TYPO, "--once"),
    ],
    ids=lambda argv: argv[0] if argv[0] != "experiment" else f"experiment-{argv[1]}",
)
def test_a_mistyped_experiment_key_says_which_key_was_meant(meant, argv):
    code, _, err = as_typed(*argv)
    assert code == 1
    assert one_line(err) == f"abplat: {DID_YOU_MEAN}"


def test_a_key_like_no_other_says_where_the_keys_are_listed_and_json_names_the_field(meant):
    code, _, err = as_typed("sla_report", "zzz")
    assert (code, one_line(err)) == (1, "abplat: no experiment 'zzz'; `manage.py experiment list` lists them")
    _, doc = failing("assign", TYPO, stdin=io.StringIO("u1\n"))
    assert doc["error"] == {"message": DID_YOU_MEAN, "field": "key", "errors": []}


def test_with_no_experiment_at_all_the_line_says_how_to_make_one(db):
    code, _, err = as_typed("experiment", "show", MEANT)
    assert one_line(err) == (
        f"abplat: no experiment {MEANT!r}; there are none yet: `manage.py apply_experiment FILE` makes one"
    )


def test_a_known_experiment_without_weights_still_says_why(db, document, users):
    services.apply_document(document, actor=users["product"])  # a draft: no weights yet
    code, _, err = as_typed("assign", "ttft-opt")
    assert one_line(err) == (
        "abplat: experiment 'ttft-opt' is a draft: its weights are published when it starts"
    )


def test_traceback_shows_the_failure_as_django_would(meant):
    from experiments.cli import CliError

    with pytest.raises(CliError, match="did you mean"):
        as_typed("sla_report", TYPO, "--traceback")


@pytest.fixture
def locked_chdb(tmp_path, settings, monkeypatch):
    """An embedded store directory another process holds: its status file locked and naming the
    holder's pid, as chDB leaves it (samples.backends.chdb probes that lock)."""
    from samples import factory
    from samples.backends import chdb

    path = tmp_path / "chdb"
    path.mkdir()
    status = open(path / "status", "w")  # noqa: SIM115 - held until the test ends
    status.write("PID: 4242\n")
    status.flush()
    fcntl.flock(status.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    settings.CLICKHOUSE_URL, settings.CHDB_PATH = "", path
    settings.SPOOL_DIR = tmp_path / "spool"
    monkeypatch.setattr(factory, "_cache", {})
    # This process may hold the session's own chDB: as a process that owns none, the command
    # then meets the lock (the owner comes back when the test ends).
    monkeypatch.setattr(chdb, "_owner", None)
    yield path
    status.close()


@pytest.mark.parametrize("argv", [("sla_report", "ttft-opt"), ("flush_samples",)], ids=lambda a: a[0])
def test_the_embedded_store_held_by_another_process_is_one_line_saying_what_to_stop(
    experiment, locked_chdb, argv
):
    code, _, err = as_typed(*argv)
    assert code == 1
    line = one_line(err)
    assert line.startswith(
        f"abplat: chDB data directory {locked_chdb} is locked by another process (pid 4242)"
    )
    assert "Stop that process" in line and "ABPLAT_CLICKHOUSE_URL" in line


def test_a_mistyped_engine_flag_names_the_flag_meant_instead_of_every_flag():
    [problem] = check_engine_args({"max_num_seq": 64})
    assert (
        problem.message
        == "--max-num-seq is not an engine flag a variant may set; did you mean --max-num-seqs?"
    )
    [problem] = check_engine_args({"trust_remote_cod": True})
    assert problem.message.startswith(
        "--trust-remote-cod is not an engine flag a variant may set; did you mean "
        "--trust-remote-code? (a risky one: runs Python code"
    )
    assert "max-model-len" not in problem.message  # no list to read past
    # Nothing close: the lists are the help (tests/foundation/test_engine_args.py).
    [problem] = check_engine_args({"api_key": "k"})
    assert "did you mean" not in problem.message and "Allowed: " in problem.message


def test_a_document_with_a_mistyped_engine_flag_is_refused_in_one_line_naming_the_flag_meant(
    db, document, tmp_path
):
    document["variants"][1]["engine_args"] = {"quantization": "awq", "max_num_seq": 64}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(document))
    code, _, err = as_typed("apply_experiment", str(path))
    assert code == 1
    assert one_line(err) == (
        f"abplat: {path}: rejected, nothing changed: variants[1].engine_args.max_num_seq: variant 'awq': "
        "--max-num-seq is not an engine flag a variant may set; did you mean --max-num-seqs?"
    )


# ---- a replay queued on a broker that no worker serves ----------------------------------------


class Clock:
    """The replay command's clock and pause (workers/management/commands/replay.py): a pause
    moves the clock; at ``worker_at`` seconds a worker takes the run and finishes it."""

    def __init__(self, worker_at: float) -> None:
        self.now, self.worker_at = 0.0, worker_at

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds
        if self.now >= self.worker_at:
            ReplayRun.objects.update(status=ReplayRun.Status.DONE)


@pytest.fixture
def on_a_broker(settings):
    # Queued on commit, and this test's transaction never commits: no worker ever sees the run.
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = "redis://:s3cret@mq.internal:6379/0"


@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_replay_wait_says_once_that_no_worker_took_the_run_and_how_to_start_one(
    running, sample_store, on_a_broker, monkeypatch
):
    from workers.management.commands import replay

    clock = Clock(worker_at=25.0)
    monkeypatch.setattr(replay.Command, "clock", staticmethod(clock))
    monkeypatch.setattr(replay.Command, "pause", staticmethod(clock.pause))
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        TRACE,
        "--limit",
        "5",
        "--no-preflight",
        "--wait",
        stdout=out,
        stderr=err,
    )
    run = ReplayRun.objects.get()
    said = [line for line in err.getvalue().splitlines() if "no worker" in line]
    assert said == [
        f"run {run.pk}: queued on redis://mq.internal:6379/0, no worker has taken it after 10 s: "
        "start one with `celery -A abplat worker` (still waiting)"
    ]
    assert "s3cret" not in err.getvalue() + out.getvalue()
    assert f"run {run.pk} done" in out.getvalue()  # it kept waiting, and the worker came


@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_replay_wait_says_nothing_when_a_worker_takes_the_run_in_time(
    running, sample_store, on_a_broker, monkeypatch
):
    from workers.management.commands import replay

    clock = Clock(worker_at=9.5)
    monkeypatch.setattr(replay.Command, "clock", staticmethod(clock))
    monkeypatch.setattr(replay.Command, "pause", staticmethod(clock.pause))
    err = io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        TRACE,
        "--limit",
        "5",
        "--no-preflight",
        "--wait",
        stdout=io.StringIO(),
        stderr=err,
    )
    assert "no worker" not in err.getvalue()


@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
def test_replay_without_wait_says_where_it_queued_and_what_runs_it(running, sample_store, on_a_broker):
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, "--limit", "5", "--no-preflight", stdout=out)
    run = ReplayRun.objects.get()
    assert run.status == ReplayRun.Status.QUEUED
    assert (
        "queued on redis://mq.internal:6379/0 for a worker (`celery -A abplat worker`); follow it with "
        f"the API /api/replays/{run.pk}/ or the admin, or pass --wait"
    ) in out.getvalue()


@pytest.fixture
def dead_clickhouse(settings, monkeypatch):
    """A ClickHouse server URL where nothing listens (port 1 refuses at once)."""
    from samples import factory

    settings.CLICKHOUSE_URL = "clickhouse://127.0.0.1:1/abplat"
    monkeypatch.setattr(factory, "_cache", {})


@pytest.mark.parametrize("argv", [("sla_report", "ttft-opt"), ("clickhouse_migrate",)], ids=lambda a: a[0])
def test_a_clickhouse_server_that_is_down_is_one_line_without_the_driver_s_tracebacks(
    experiment, dead_clickhouse, caplog, argv
):
    caplog.set_level("WARNING")
    code, _, err = as_typed(*argv)
    assert code == 1
    line = one_line(err)
    assert "clickhouse://127.0.0.1:1/abplat unavailable" in line and "Is it running?" in line, line
    # The driver logs each failed connect with its traceback; the wrapper's line says it instead.
    assert not [r for r in caplog.records if r.name.startswith("clickhouse_driver")], caplog.text


def test_a_database_without_its_tables_says_to_migrate_and_one_that_is_down_says_so(db):
    from django.db import connection
    from django.db.utils import DatabaseError

    from experiments.cli import database_failure

    with pytest.raises(DatabaseError) as missing:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM abplat_no_such_table")
    message = str(database_failure(missing.value))
    assert "has no table abplat_no_such_table" in message and "manage.py migrate" in message, message
    assert connection.settings_dict["NAME"] in message
    assert database_failure(ValueError("not a database failure")) is None
