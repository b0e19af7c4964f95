"""A gateway process recording live traffic is SIGKILLed mid-batch, while the store is down, and
started again: no sample is duplicated, and none that record() took is lost.

The guarantee under test (gateway/recording.py): a sample is safe once record() returned (it is
in the process's queue file, which the host's recorder process drains, to the store or the
spool); a killed gateway's file is drained and its run closed. Seqs follow the file, so what the
killed run leaves in the store is exactly seq 1..K, K at least every sample the process said it
had handed over. Real processes: two gateway-like children on a file SQLite and the real
ClickHouse server, reached through a proxy this test switches off ("the store went down"), and
the recorder process the first of them starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.parse
import uuid
from pathlib import Path

import pytest

from gateway import record_queue
from samples.backends.clickhouse import ClickHouseServerBackend
from tests.plugin import TEST_SECRET_KEY, FlakyProxy, server_url_for
from tests.samples.conftest import wait_until
from tests.workers.background import manage

ROOT = Path(__file__).resolve().parents[2]

# One gateway process: records `count` requests as fast as it can (tag-i request ids), printing
# after every 10 how many it handed over and how many of them its recorder has written (store or
# spool); then closes the recorder, unless it is killed first.
CHILD = r"""
import os, sys, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
django.setup()
from gateway.recording import LiveRecorder
from streaming.result import Outcome, StreamResult

count, tag = int(sys.argv[1]), sys.argv[2]
rec = LiveRecorder(worker=f"gw-{tag}:{os.getpid()}", batch_rows=25, flush_ms=5.0, retry_s=0.3, heartbeat_s=0.2)
rec.start()
print("RUN", rec.run_id, flush=True)
for i in range(count):
    result = StreamResult(outcome=Outcome.OK, http_status=200, ttfb_ms=1.0, ttft_event_ms=2.0, ttft_ms=2.5,
                          e2e_ms=9.0, output_tokens=4, chunks=4, finish_reason="stop")
    rec.record(result, experiment="ttft-opt", variant=("fp16", "awq")[i % 2], user_id=f"u{i % 9}",
               config_revision=3, sent_unix_ms=time.time() * 1000.0, request_id=f"{tag}-{i}",
               prompt_tokens=12, max_tokens=16, gateway_ms=0.2)
    if i % 10 == 9:
        c = rec.counts()
        print("AT", i + 1, c["stored"] + c["spooled"], c["spooled"], flush=True)
        time.sleep(0.001)
print("CLOSED", rec.close(), flush=True)
"""


@pytest.fixture
def gateway_env(tmp_path, clickhouse_server):
    """(env of the children, the proxy in front of ClickHouse, a direct store of their database)."""
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    parts = urllib.parse.urlsplit(clickhouse_server)
    proxy = FlakyProxy((parts.hostname or "127.0.0.1", parts.port or 9000))
    proxy.up()
    direct = server_url_for(database, clickhouse_server)
    via_proxy = urllib.parse.urlunsplit(
        urllib.parse.urlsplit(direct)._replace(netloc=f"default:@127.0.0.1:{proxy.port}")
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    env = {
        **base,
        "ABPLAT_VAR": str(tmp_path),
        "ABPLAT_CLICKHOUSE_URL": via_proxy,
        "ABPLAT_SECRET_KEY": TEST_SECRET_KEY,
    }
    manage(env, "migrate", "-v0")
    manage(env, "clickhouse_migrate")
    store = ClickHouseServerBackend(direct)
    yield env, proxy, store
    stop_recorder(str(tmp_path / "spool"))
    proxy.down()
    try:
        store.execute(f"DROP DATABASE IF EXISTS {database}")
    finally:
        store.close()


def recorder_log(directory: str) -> str:
    """What the recorder a gateway started on the queue ``directory`` wrote (its stdout and stderr)."""
    try:
        return Path(directory, "recorder.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def stacks_dumped(directory: str, before: int = 0) -> bool:
    """A recorder's SIGUSR1 dump is in its log whole, after the ``before`` earlier ones: the
    dump is read while faulthandler writes it, and the main thread's stack, down to manage.py's
    module level, comes last."""
    return recorder_log(directory).count("in <module>") > before


def stop_recorder(spool_dir: str, limit_s: float = 60.0) -> None:
    """SIGTERM the recorder process a gateway started on ``spool_dir`` (if it still runs): it
    drains and exits; a test leaves no process behind. One still running after ``limit_s`` fails
    the test with its log and every thread's stack (SIGUSR1), then is killed."""
    directory = record_queue.queue_dir(spool_dir)
    pid = record_queue.recorder_pid(directory)
    if pid is None or not record_queue.recorder_running(directory):
        return
    os.kill(pid, signal.SIGTERM)
    try:
        wait_until(lambda: not record_queue.recorder_running(directory), "the recorder stopped", limit_s)
    except AssertionError:
        dumps = recorder_log(directory).count("in <module>")
        os.kill(pid, signal.SIGUSR1)
        with contextlib.suppress(AssertionError):  # a recorder that cannot run its handler writes none
            wait_until(lambda: stacks_dumped(directory, dumps), "the recorder's stacks", 10.0)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not record_queue.recorder_running(directory), "the killed recorder gone", 10.0)
        raise AssertionError(
            f"the recorder (pid {pid}) did not stop within {limit_s:g} s of SIGTERM; its log and "
            f"stacks:\n{recorder_log(directory)[-20000:]}"
        ) from None


def start_child(env: dict, count: int, tag: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(count), tag],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def read_until(child: subprocess.Popen, done) -> list[str]:
    """The child's lines until done(line) is true (or it ends: a failed assertion)."""
    seen = []
    for line in child.stdout:
        seen.append(line.strip())
        if done(line.split()):
            return seen
    raise AssertionError(f"the child ended first: {seen[-5:]}")


def seqs(store, run_id: int) -> tuple[list[int], int, int]:
    """(seqs stored, in order, rows on disk, distinct keys): without FINAL, so a copy shows."""
    got = [
        int(s)
        for (s,) in store.query("SELECT seq FROM samples WHERE run_id = %(r)s ORDER BY seq", {"r": run_id})
    ]
    [(n, keys)] = store.query(
        "SELECT count(), uniqExact(experiment, variant, run_id, request_id) FROM samples WHERE run_id = %(r)s",
        {"r": run_id},
    )
    return got, int(n), int(keys)


def run_status(env: dict, run_a: int, run_b: int) -> list[str]:
    return manage(
        env,
        "shell",
        "-c",
        "from gateway.models import LiveRun; "
        f"a = LiveRun.for_run_id({run_a}); b = LiveRun.for_run_id({run_b}); "
        "print(a.status, a.recorded, a.stored + a.spooled, a.dropped, "
        "b.status, b.recorded, b.stored + b.spooled, b.dropped, b.spool_rows)",
    ).split()[-9:]


def test_a_gateway_killed_mid_batch_and_restarted_duplicates_nothing_and_loses_nothing_it_took(gateway_env):
    env, proxy, store = gateway_env
    first = start_child(env, 10**7, "a")  # never ends by itself
    try:
        run_a = int(read_until(first, lambda w: w[0] == "RUN")[-1].split()[1])
        read_until(first, lambda w: w[0] == "AT" and int(w[2]) >= 200)  # some stored
        proxy.down()  # the store goes away mid-traffic
        lines = read_until(first, lambda w: w[0] == "AT" and int(w[3]) >= 500)  # some spooled since
        durable = int(lines[-1].split()[2])
        first.send_signal(signal.SIGKILL)  # mid-batch: it records and writes all the time
        first.wait(30)
        # what it printed before the kill landed (a loaded host reads its pipe behind it)
        said = [*lines, *(line.strip() for line in first.stdout.read().splitlines())]
        handed = int([line for line in said if line.startswith("AT ")][-1].split()[1])
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert handed >= durable

    proxy.up()
    second = start_child(env, 50, "b")  # the restarted gateway: records, closes
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0 and "CLOSED True" in out, out[-2000:]
    run_b = int(next(line for line in out.splitlines() if line.startswith("RUN")).split()[1])
    assert run_b != run_a

    # the killed run's queue file is drained by the host's recorder, and its run closed
    wait_until(lambda: run_status(env, run_a, run_b)[0] == "closed", "the killed run drained", limit_s=120.0)
    recorded_a = int(run_status(env, run_a, run_b)[1])
    # what it spooled while the store was down reaches the store at the recorder's next retry
    wait_until(
        lambda: len(seqs(store, run_a)[0]) >= recorded_a and len(seqs(store, run_b)[0]) >= 50,
        "the spool flushed",
        120.0,
    )
    got, rows, keys = seqs(store, run_a)
    k = len(got)
    assert got == list(range(1, k + 1))  # a prefix of the run: no gap
    assert rows == keys == k  # no sample twice
    # every sample it said it had handed over (before, it lost what was in its memory: k could
    # be as low as `durable`); at most the 9 it took after its last line
    assert handed <= k < handed + 10, (durable, k, handed)
    got_b, rows_b, keys_b = seqs(store, run_b)
    assert got_b == list(range(1, 51)) and rows_b == keys_b == 50

    assert run_status(env, run_a, run_b) == ["closed", str(k), str(k), "0", "closed", "50", "50", "0", "0"]
    # the run catalog the report reads: both done (nothing of the killed one was lost)
    done = {run_a: ("live", "done"), run_b: ("live", "done")}
    wait_until(  # told at the recorder's heartbeat after the spool's flush
        lambda: {r["run_id"]: (r["mode"], r["status"]) for r in store.runs("ttft-opt")} == done,
        "both runs catalogued done",
        60.0,
    )


def test_sigusr1_writes_the_recorder_s_stacks_to_its_log_and_it_goes_on_and_stops_on_sigterm(
    gateway_env, tmp_path
):
    env, _proxy, store = gateway_env
    child = start_child(env, 30, "s")
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and "CLOSED True" in out, out[-2000:]
    directory = record_queue.queue_dir(str(tmp_path / "spool"))
    pid = record_queue.recorder_pid(directory)
    assert pid is not None and record_queue.recorder_running(directory)  # idle, it waits 10 s

    os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: stacks_dumped(directory), "the recorder's stacks in recorder.log")
    log = recorder_log(directory)
    # the flush loop's thread waits on its queue, the main thread in its reading loop
    assert all(s in log for s in ("flush.py", "recorder_process.py", "in run")), log[-4000:]
    assert record_queue.recorder_running(directory)  # a dump, not an exit

    stop_recorder(str(tmp_path / "spool"), limit_s=30.0)
    assert not record_queue.recorder_running(directory)
    [(n,)] = store.query("SELECT count() FROM samples WHERE request_id LIKE 's-%%'")
    assert n == 30
