"""Structured logs (telemetry/logs.py): one JSON object a line that a user's value cannot break,
the context fields on the replay's lines, the request id of the API, and the setting."""

import io
import json
import logging
import re
import subprocess
import sys

import pytest
from django.core.management import call_command

from abplat.request_id import request_id_from
from replay.sink import BatchSink
from simulator.serve import start_in_thread
from telemetry import logs
from tests.workers.background import ROOT, manage, start_demo_experiment, start_worker, stop_all, wait_for
from tests.workers.conftest import broker_env  # noqa: F401 (the fixture, reused)
from workers.models import ReplayRun
from workers.tasks import start_replay

TRACE = "data/traces/azure_llm_2023_code.csv"
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
# What a user might put into a key, a header or a trace line to forge a field or a line.
NASTY = 'x"}\n{"level": "CRITICAL", "run": 1}\r\n\x00\x1b[31m\u2028\u2029\\ end'


def no_nan(name):
    raise AssertionError(f"invalid JSON constant {name}")


def one_object(line: str) -> dict:
    """``line`` is one complete JSON object and nothing else (strict: no NaN)."""
    assert line == line.strip() and "\n" not in line and "\r" not in line
    assert line.isascii() and len(line.splitlines()) == 1  # no U+2028 either
    return json.loads(line, parse_constant=no_nan)


def record(msg="hello %s", args=("world",), exc_info=None, **extra):
    rec = logging.LogRecord("workers.shard", logging.WARNING, __file__, 1, msg, args, exc_info)
    rec.created, rec.msecs = 1796122481.0457, 45.7  # 2026-12-01T10:54:41.045Z
    rec.__dict__.update(extra)
    return rec


# formatter --------------------------------------------------------------------------------------


def test_a_json_line_has_time_level_logger_message_and_context():
    with logs.log_context(experiment="ttft-opt", run=7, shard=2):
        out = one_object(logs.JsonFormatter().format(record()))
    assert out == {
        "ts": "2026-12-01T10:54:41.045Z",
        "level": "WARNING",
        "logger": "workers.shard",
        "message": "hello world",
        "experiment": "ttft-opt",
        "run": 7,
        "shard": 2,
    }
    assert TS.match(out["ts"])


def test_an_exception_is_one_string_field_with_its_traceback():
    try:
        raise KeyError("missing\nline")
    except KeyError:
        rec = record(exc_info=sys.exc_info())
    out = one_object(logs.JsonFormatter().format(rec))
    assert out["exception"].startswith("Traceback (most recent call last):")
    assert "KeyError: 'missing\\nline'" in out["exception"] and "raise KeyError" in out["exception"]


def test_user_values_cannot_forge_fields_or_lines():
    with logs.log_context(experiment=NASTY, request_id=NASTY):
        line = logs.JsonFormatter().format(record("got %s", (NASTY,), tenant=NASTY))
    out = one_object(line)
    assert out["message"] == f"got {NASTY}" and out["experiment"] == NASTY and out["tenant"] == NASTY
    assert out["level"] == "WARNING" and "run" not in out
    # the same through a real handler: exactly one line in the stream
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("tests.telemetry.forge")
    logger.addHandler(handler)
    try:
        logger.error("quote %s", NASTY, extra={"variant": NASTY})
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 2
    assert one_object(lines[0])["variant"] == NASTY


def test_extra_fields_never_replace_the_fixed_ones_and_odd_values_stay_valid_json():
    rec = record(
        level="DEBUG",
        logger="fake",
        ts="0",
        ratio=float("nan"),
        big=float("inf"),
        obj=object(),
        nested={"x": [float("-inf")]},
    )
    out = one_object(logs.JsonFormatter().format(rec))
    assert (out["level"], out["logger"], out["ts"]) == (
        "WARNING",
        "workers.shard",
        "2026-12-01T10:54:41.045Z",
    )
    assert out["ratio"] == "nan" and out["big"] == "inf" and out["nested"] == {"x": ["-inf"]}
    assert out["obj"].startswith("<object object")


def test_the_text_line_carries_the_context_quoted_when_needed():
    with logs.log_context(experiment="ttft-opt", run=3, variant="a b\nc"):
        line = logs.TextFormatter().format(record())
    assert line.endswith('hello world [experiment=ttft-opt run=3 variant="a b\\nc"]')
    assert "\n" not in line
    assert logs.TextFormatter().format(record()).endswith("workers.shard: hello world")
    try:
        raise KeyError("k")
    except KeyError:
        rec = record(exc_info=sys.exc_info())
    with logs.log_context(run=3):
        first, *traceback = logs.TextFormatter().format(rec).split("\n")
    assert first.endswith("hello world [run=3]") and traceback[-1] == "KeyError: 'k'"


# context ----------------------------------------------------------------------------------------


def test_context_nests_and_ends_with_its_block():
    assert logs.current_context() == {}
    with logs.log_context(experiment="e", run=1):
        with logs.log_context(shard=3, run=2):
            assert logs.current_context() == {"experiment": "e", "run": 2, "shard": 3}
            token = logs.bind(shard=None)  # None: not known here
            assert logs.current_context() == {"experiment": "e", "run": 2}
            logs.reset(token)
        assert logs.current_context() == {"experiment": "e", "run": 1}
    assert logs.current_context() == {}


@pytest.mark.parametrize("name", ["message", "level", "ts", "exception", "not an identifier"])
def test_a_context_field_may_not_take_a_reserved_or_odd_name(name):
    with pytest.raises(ValueError, match="log context field"):
        logs.bind(**{name: 1})


def test_context_from_args_binds_arguments_and_keeps_the_signature():
    seen = []

    @logs.context_from_args(run="run_id", shard="index")
    def task(run_id: int, index: int, retries: int = 0):
        logs.bind(experiment="e")  # ends with the call
        seen.append(logs.current_context())

    task(5, index=1)
    assert seen == [{"run": 5, "shard": 1, "experiment": "e"}] and logs.current_context() == {}
    assert str(__import__("inspect").signature(task)) == "(run_id: int, index: int, retries: int = 0)"
    with pytest.raises(TypeError):
        task(1, 2, 3, 4)
    with pytest.raises(TypeError, match="no argument"):
        logs.context_from_args(run="nope")(task)


def test_celery_still_checks_a_task_s_arguments():
    with pytest.raises(TypeError):
        start_replay.apply_async(args=(1, 2, 3))


def test_the_sample_writer_thread_logs_in_the_shard_s_context(json_log):
    def refuse(rows):
        raise OSError("disk full")

    with logs.log_context(experiment="e", run=5, shard=1):
        sink = BatchSink(refuse, max_age_s=0.01)  # its thread starts here
    sink.put({"seq": 0})
    with pytest.raises(RuntimeError, match="disk full"):
        sink.close()
    [line] = [x for x in json_log() if x["logger"] == "replay.sink"]
    assert line["message"] == "writing 1 samples failed: disk full"
    assert (line["experiment"], line["run"], line["shard"]) == ("e", 5, 1)


# a real replay, embedded (eager Celery) ----------------------------------------------------------


@pytest.fixture
def json_log():
    """Every record of the process as the JSON handler of settings.LOGGING writes it, at INFO."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.ContextFilter())
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("workers", "django.request")}
    root.addHandler(handler)
    for name in levels:
        logging.getLogger(name).setLevel(logging.INFO)
    yield lambda: [one_object(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.engine
def test_a_replay_s_lines_carry_experiment_run_shard_and_variant(running, sample_store, json_log):
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, "--limit", "40", "--speed", "200", stdout=out)
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out.getvalue())
    lines = json_log()
    ours = [x for x in lines if x["logger"].startswith("workers.")]
    assert ours, lines
    # every line of the replay's glue names the experiment and the run
    assert all(x.get("experiment") == "ttft-opt" and x.get("run") == run.pk for x in ours), ours
    shard_lines = [x for x in ours if x["logger"] == "workers.shard" and "shard" in x]
    summaries = [x for x in shard_lines if x["message"].startswith(f"run {run.pk} shard {x['shard']}: {{")]
    assert [x["shard"] for x in summaries] == [0]  # eager Celery: one shard
    # the shard's task (eager Celery still runs it as a task) names itself
    assert re.fullmatch(r"[0-9a-f-]{36}", summaries[0].get("task_id", "")), summaries
    # the prompt plan is per variant
    plans = [x for x in ours if "prompts for" in x["message"]]
    assert sorted(x["variant"] for x in plans) == sorted(v.key for v in running.variants.all())
    assert all(x["message"].startswith(f"run {run.pk}: prompts for {x['variant']}:") for x in plans)
    # nothing is left bound after the command
    assert logs.current_context() == {}


# the API: a request id on every line, echoed back ----------------------------------------------


@pytest.mark.django_db
def test_a_request_s_lines_carry_its_id_which_is_echoed_back(client, json_log):
    response = client.get("/no/such/page", HTTP_X_REQUEST_ID="req-42.a:b")
    assert response.status_code == 404 and response["X-Request-Id"] == "req-42.a:b"
    not_found = [x for x in json_log() if x["logger"] == "django.request"]
    assert not_found and all(x["request_id"] == "req-42.a:b" for x in not_found), not_found


@pytest.mark.django_db
@pytest.mark.parametrize("sent", [NASTY, "", "-starts-with-dash", "x" * 129, "a b", "ü"])
def test_an_invalid_request_id_is_replaced_by_a_generated_one(client, json_log, sent):
    response = client.get("/no/such/page", HTTP_X_REQUEST_ID=sent)
    echoed = response["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", echoed)
    assert [x["request_id"] for x in json_log() if x["logger"] == "django.request"] == [echoed]


def test_request_ids_without_a_header_are_new_each_time():
    assert request_id_from(None) != request_id_from(None)
    assert request_id_from("x" * 128) == "x" * 128


# the setting --------------------------------------------------------------------------------


def manage_py(*args: str, **env: str) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_LOG")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
def test_log_format_json_makes_every_line_an_object_and_a_bad_value_stops_the_process():
    code = (
        "import logging; from telemetry.logs import log_context\n"
        "with log_context(run=4): logging.getLogger('workers.x').warning('hi %s', 'there')"
    )
    done = manage_py("shell", "-c", code, ABPLAT_LOG_FORMAT="json")
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("{")]
    out = one_object(line)
    assert (out["message"], out["logger"], out["run"]) == ("hi there", "workers.x", 4)
    text = manage_py("shell", "-c", code)
    assert text.returncode == 0 and text.stderr.rstrip().endswith("workers.x: hi there [run=4]"), text.stderr
    bad = manage_py("check", ABPLAT_LOG_FORMAT="yaml")
    assert bad.returncode != 0
    assert "ABPLAT_LOG_FORMAT='yaml': use one of text, json" in bad.stderr + bad.stdout


# a real Celery worker -----------------------------------------------------------------------


@pytest.mark.services
def test_a_celery_worker_logs_json_with_the_task_s_fields(broker_env, tmp_path):  # noqa: F811
    env = {**broker_env, "ABPLAT_LOG_FORMAT": "json"}
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    log = tmp_path / "worker.log"
    workers = []
    try:
        start_demo_experiment(env, tmp_path, sims)
        workers = [start_worker(env, log)]
        manage(
            env,
            "replay",
            "ttft-optimizations",
            "--trace",
            TRACE,
            "--limit",
            "30",
            "--speed",
            "100",
            "--shards",
            "2",
            "--wait",
        )
        # the run's last task has ended (stopping the worker earlier would interrupt it)
        wait_for(lambda: re.search(r"finish_replay\[[^]]+\] succeeded", log.read_text()), timeout=60)
    finally:
        stop_all(workers, sims)
    text = log.read_text()
    # Celery's own format never appears: it did not take over the root logger
    assert not re.search(r"^\[\d{4}-\d\d-\d\d [^]]*: (INFO|WARNING|ERROR)/", text, re.M), text[-3000:]
    lines = [one_object(x) for x in text.splitlines() if x.startswith("{")]
    assert any(x["logger"].startswith("celery.") for x in lines), text[-3000:]  # celery's lines, as JSON
    summaries = [
        x
        for x in lines
        if x["logger"] == "workers.shard"
        and "shard" in x
        and x["message"].startswith(f"run 1 shard {x['shard']}: {{")
    ]
    assert sorted(x["shard"] for x in summaries) == [0, 1], text[-3000:]
    for x in summaries:
        assert (x["experiment"], x["run"]) == ("ttft-optimizations", 1)
        assert re.fullmatch(r"[0-9a-f-]{36}", x["task_id"])
    assert len({x["task_id"] for x in summaries}) == 2
