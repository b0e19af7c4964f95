"""ABPLAT_METRICS_DIR: several processes write, one scrape adds them up; a process that dies
(even by SIGKILL) takes its live gauges with it and leaves its counters; the settings are checked
strictly at start (in this process on a dict, abplat.config.settings_from; a real process where
the directory or the moment the mode is fixed is what is tested)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from telemetry import metrics, metrics_config
from tests.foundation.test_settings import refusal
from tests.telemetry.conftest import parse, total
from tests.workers.background import ROOT

# A process that records, says "ready", and waits for a line on stdin before it exits.
WRITER = textwrap.dedent("""
    import sys
    if sys.argv[1] == "library-first":
        import prometheus_client  # before abplat's module: it must still write to the directory
    from telemetry import metrics
    meter = metrics.ReplayMeter("mp-exp")
    for _ in range(int(sys.argv[2])):
        meter.sent("a")
        meter.completed("a", "ok", 0.003)
    metrics.REPLAY_SHARDS_RUNNING.inc()
    metrics.SPOOL_ROWS.set(int(sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.readline()
""")
SCRAPE = "from telemetry import metrics; import sys; sys.stdout.write(metrics.exposition()[0].decode())"


def env_with(directory) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ABPLAT_", "PROMETHEUS_"))}
    return {**env, "ABPLAT_METRICS_DIR": str(directory), "PYTHONPATH": str(ROOT)}


def start_writer(env, mode: str, n: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, mode, str(n)],
        cwd=ROOT,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()
    return proc


def scrape(env):
    out = subprocess.run(
        [sys.executable, "-c", SCRAPE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return parse(out.stdout)


@pytest.mark.process
def test_two_processes_are_summed_and_a_dead_one_keeps_its_counts_but_not_its_gauges(tmp_path):
    env = env_with(tmp_path / "metrics")
    a = start_writer(env, "abplat-first", 3)
    b = start_writer(env, "library-first", 4)
    try:
        both = scrape(env)
        assert total(both, "abplat_replay_requests_sent_total", experiment="mp-exp", variant="a") == 7
        assert total(both, "abplat_replay_requests_completed_total", outcome="ok") == 7
        assert total(both, "abplat_replay_schedule_lag_seconds_count", experiment="mp-exp") == 7
        assert total(both, "abplat_replay_shards_running") == 2  # livesum
        assert total(both, "abplat_spool_rows") == 4  # livemostrecent: the last one set
        # One is killed without any exit hook: the next scrape finds its pid gone.
        os.kill(b.pid, signal.SIGKILL)
        b.wait()
        after_kill = scrape(env)
        assert total(after_kill, "abplat_replay_shards_running") == 1
        assert total(after_kill, "abplat_spool_rows") == 3
        assert total(after_kill, "abplat_replay_requests_sent_total") == 7  # counters stay
        # The other exits normally: atexit removes its live gauges itself.
        a.communicate("bye\n", timeout=30)
        assert a.returncode == 0
        assert not list((tmp_path / "metrics").glob(f"gauge_live*_{a.pid}.db"))
        after_exit = scrape(env)
        assert total(after_exit, "abplat_replay_shards_running") == 0
        assert total(after_exit, "abplat_replay_requests_sent_total") == 7
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.process
def test_only_abplat_families_are_exposed_from_the_directory(tmp_path):
    env = env_with(tmp_path / "metrics")
    code = (
        "import prometheus_client; from telemetry import metrics; "
        "prometheus_client.Counter('other_library_things', 'x').inc(); metrics.SPOOL_SPOOLED_ROWS.inc(2)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
    exposed = scrape(env)
    assert total(exposed, "abplat_spool_spooled_rows_total") == 2
    assert all(name.startswith("abplat_") for name, _ in exposed)


@pytest.mark.process
def test_gunicorn_child_exit_removes_the_workers_live_gauges(tmp_path):
    env = env_with(tmp_path / "metrics")
    worker = start_writer(env, "abplat-first", 1)
    try:
        code = (
            "import sys, types; from telemetry import metrics; "
            "metrics.gunicorn_child_exit(None, types.SimpleNamespace(pid=int(sys.argv[1])))"
        )
        assert list((tmp_path / "metrics").glob(f"gauge_live*_{worker.pid}.db"))
        subprocess.run(
            [sys.executable, "-c", code, str(worker.pid)], cwd=ROOT, env=env, check=True, timeout=60
        )
        assert not list((tmp_path / "metrics").glob(f"gauge_live*_{worker.pid}.db"))
        assert list((tmp_path / "metrics").glob(f"counter_{worker.pid}.db"))  # its counts stay
    finally:
        worker.kill()
        worker.wait()


def check(env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "setup, message",
    [
        (
            lambda d: {"ABPLAT_METRICS_DIR": str(d / "a-file")},
            "Unexpected value ABPLAT_METRICS_DIR='{d}/a-file': {d}/a-file exists and is not a directory.",
        ),
        (
            lambda d: {"ABPLAT_METRICS_DIR": str(d / "a-file" / "below")},
            "Unexpected value ABPLAT_METRICS_DIR='{d}/a-file/below': cannot create the directory",
        ),
        (
            lambda d: {"PROMETHEUS_MULTIPROC_DIR": str(d)},
            "PROMETHEUS_MULTIPROC_DIR='{d}' is set but ABPLAT_METRICS_DIR is not",
        ),
        (
            lambda d: {"ABPLAT_METRICS_DIR": str(d / "m"), "PROMETHEUS_MULTIPROC_DIR": str(d / "other")},
            "ABPLAT_METRICS_DIR='{d}/m' and PROMETHEUS_MULTIPROC_DIR='{d}/other' name different directories",
        ),
    ],
    ids=["file", "uncreatable", "theirs-only", "two-dirs"],
)
@pytest.mark.process
def test_a_bad_metrics_directory_stops_the_process_at_start_with_one_line(tmp_path, setup, message):
    # A real process: the directory is checked while settings load, before anything imports
    # telemetry.metrics (whose import would fail on it with a traceback).
    (tmp_path / "a-file").write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
    env.update(setup(tmp_path))
    result = check(env)
    assert result.returncode != 0
    assert result.stderr.startswith("abplat: configuration error: " + message.format(d=tmp_path)), (
        result.stderr
    )
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "setup, message",
    [
        (
            lambda d: {"ABPLAT_WORKER_METRICS_PORT": "9108"},
            "ABPLAT_WORKER_METRICS_PORT=9108 needs ABPLAT_METRICS_DIR",
        ),
        (
            lambda d: {"ABPLAT_WORKER_METRICS_PORT": "70000"},
            "Unexpected value ABPLAT_WORKER_METRICS_PORT='70000'",
        ),
        (
            lambda d: {"ABPLAT_METRICS_ALLOWED_CIDRS": "10.0.0.0/8,lan"},
            "Unexpected value ABPLAT_METRICS_ALLOWED_CIDRS item 'lan'",
        ),
        (lambda d: {"ABPLAT_METRICS_ALLOWED_CIDRS": "none"}, "nobody could read /metrics"),
        (
            lambda d: {"ABPLAT_METRICS_TOKEN_FILE": str(d / "short-token")},
            "Unexpected value ABPLAT_METRICS_TOKEN_FILE='{d}/short-token': the file must hold one token",
        ),
        (
            lambda d: {"ABPLAT_METRICS_TOKEN_FILE": str(d / "missing")},
            "Unexpected value ABPLAT_METRICS_TOKEN_FILE='{d}/missing': cannot read it",
        ),
    ],
    ids=["port-without-dir", "port-range", "cidr", "nobody", "short-token", "missing-token"],
)
def test_a_bad_metrics_setting_stops_the_process_at_start_naming_it(tmp_path, setup, message):
    (tmp_path / "short-token").write_text("abc\n")
    environ = {"ABPLAT_DEBUG": "true", "ABPLAT_VAR": str(tmp_path / "var"), **setup(tmp_path)}
    assert message.format(d=tmp_path) in refusal(environ)


# manage.py check, with what the process holds after loading its settings and after the command.
OBSERVED_CHECK = textwrap.dedent("""
    import json, os, runpy, sys
    os.environ["DJANGO_SETTINGS_MODULE"] = "abplat.settings"
    from django.conf import settings
    settings.INSTALLED_APPS
    loaded = [m for m in ("telemetry.metrics", "prometheus_client") if m in sys.modules]
    made = os.path.isdir(os.environ["ABPLAT_METRICS_DIR"])
    sys.argv = ["manage.py", "check"]
    runpy.run_path("manage.py", run_name="__main__")
    from prometheus_client import values
    from telemetry import metrics
    print(json.dumps({"settings_load": loaded, "made": made, "mode": metrics.METRICS_DIR,
                      "theirs": os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                      "files": getattr(values.ValueClass, "_multiprocess", False)}))
""")


@pytest.mark.process
def test_a_good_multiprocess_setting_passes_and_app_start_creates_the_directory(tmp_path):
    # Loading the settings checks the directory without making it and leaves the metrics mode
    # alone (nothing imports telemetry.metrics or prometheus_client); app start makes the
    # directory and fixes the mode, before the command runs (workers/apps.py, configure_metrics).
    (tmp_path / "token").write_text("t" * 32 + "\n")
    directory = tmp_path / "new" / "metrics"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_")}
    env.update(
        ABPLAT_METRICS_DIR=str(directory),
        ABPLAT_WORKER_METRICS_PORT="9108",
        ABPLAT_METRICS_TOKEN_FILE=str(tmp_path / "token"),
        ABPLAT_METRICS_ALLOWED_CIDRS="none",
    )
    result = subprocess.run(
        [sys.executable, "-c", OBSERVED_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert directory.is_dir()
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["settings_load"] == [] and seen["made"] is False
    assert seen["mode"] == seen["theirs"] == str(directory) and seen["files"] is True


def test_settings_check_the_directory_by_reading_the_disk_only(tmp_path):
    # check_dir_would_work (settings) accepts what check_dir (app start) would, making nothing.
    missing = tmp_path / "new" / "metrics"
    assert metrics_config.check_dir_would_work(str(missing)) == str(missing)
    assert not (tmp_path / "new").exists()
    environ = {"ABPLAT_METRICS_DIR": str(missing), "PROMETHEUS_MULTIPROC_DIR": str(missing)}
    assert metrics_config.multiprocess_dir(environ, make=False) == str(missing)
    assert not (tmp_path / "new").exists()
    assert metrics_config.check_dir_would_work(str(tmp_path)) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no probe file written
    (tmp_path / "a-file").write_text("x")
    for raw, message in (
        (tmp_path / "a-file", f"{tmp_path}/a-file exists and is not a directory."),
        (
            tmp_path / "a-file" / "below",
            f"cannot create the directory {tmp_path}/a-file/below: Not a directory.",
        ),
    ):
        with pytest.raises(metrics.MetricsConfigError) as refused:
            metrics_config.check_dir_would_work(str(raw))
        assert str(refused.value) == f"Unexpected value ABPLAT_METRICS_DIR={str(raw)!r}: {message}"
        with pytest.raises(metrics.MetricsConfigError) as made:
            metrics_config.check_dir(str(raw))
        assert str(made.value) == str(refused.value)  # the same words as app start's check


def test_settings_refuse_a_metrics_directory_this_process_may_not_write(tmp_path, monkeypatch):
    # The process runs as root in CI (permissions do not stop it): the kernel's refusal is simulated.
    monkeypatch.setattr(metrics_config.os, "access", lambda *_a, **_k: False)
    with pytest.raises(
        metrics.MetricsConfigError,
        match=r"ABPLAT_METRICS_DIR=.*the directory .* is not writable by this process",
    ):
        metrics_config.check_dir_would_work(str(tmp_path))
    with pytest.raises(
        metrics.MetricsConfigError,
        match=rf"cannot create the directory {tmp_path}/new: Permission denied\.$",
    ):
        metrics_config.check_dir_would_work(str(tmp_path / "new"))
    assert list(tmp_path.iterdir()) == []


def test_check_dir_refuses_a_directory_it_cannot_write(tmp_path, monkeypatch):
    # The process runs as root in CI (permissions do not stop it): a write that fails is simulated.
    def refuse(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(metrics_config.tempfile, "mkstemp", refuse)
    with pytest.raises(
        metrics.MetricsConfigError, match=r"ABPLAT_METRICS_DIR=.*is not writable by this process"
    ):
        metrics_config.check_dir(str(tmp_path))


def test_a_worker_host_serves_its_pool_childrens_metrics_on_its_own_port(broker_env, tmp_path):
    """ABPLAT_WORKER_METRICS_PORT: the Celery worker's main process serves what its prefork
    children record (each flushes the spool on its timer a few seconds after it starts); a warm
    shutdown takes the children's live gauges with it."""
    from tests.telemetry.conftest import free_port, wait_until
    from tests.telemetry.conftest import scrape as scrape_url
    from tests.workers.background import manage, start_worker, stop_all

    port = free_port()
    directory = tmp_path / "metrics"
    env = {**broker_env, "ABPLAT_METRICS_DIR": str(directory), "ABPLAT_WORKER_METRICS_PORT": str(port)}
    manage(env, "migrate", "-v0")
    manage(env, "clickhouse_migrate")
    log = tmp_path / "worker.log"
    worker = start_worker(env, log)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        # Both children flushed (an empty spool: result ok), summed by the main process.
        wait_until(
            lambda: total(scrape_url(url), "abplat_spool_flushes_total", result="ok") >= 2,
            60,
            "both children's first flush",
            [log],
        )
        assert total(scrape_url(url), "abplat_spool_rows") == 0
        children = {int(p.stem.rsplit("_", 1)[1]) for p in directory.glob("gauge_live*_*.db")}
        assert len(children) >= 2, sorted(p.name for p in directory.iterdir())
    finally:
        stop_all([worker], [])
    assert worker.returncode == 0, log.read_text()[-3000:]
    # worker_process_shutdown ran in each child: no live gauge of theirs is left.
    assert not [
        p.name for p in directory.glob("gauge_live*_*.db") if int(p.stem.rsplit("_", 1)[1]) in children
    ]
    assert list(directory.glob("counter_*.db"))  # their counts stay
