"""Two gateway processes behind one address (`manage.py gateway --workers 2`, the real ClickHouse
server, the simulator), streams under way on both, one process SIGKILLed mid-stream: every
request the client saw complete has exactly one sample, none twice, and the counts are exact.

What becomes of the streams the kill cut: their client sees the connection cut (no complete
response), and they have no sample (the gateway records a request at its end, and nothing runs
in a killed process). A stream whose sample was written just before the kill cut its last bytes
may have one: a sample of a request the client saw cut, never two.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from experiments import services
from gateway import record_queue
from gateway.models import LiveRun
from simulator.serve import start_in_thread
from tests.gateway.conftest import KEY
from tests.gateway.test_command import start_gateway_command
from tests.gateway.test_recording_killed import stop_recorder
from tests.samples.conftest import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine, pytest.mark.services]

STREAMS = 24  # at once, per wave


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def writer_pid(queue_dir: str, run_id: int) -> int:
    """The pid of a queue file's writer (its header record says)."""
    [(header, _end)], _at, _partial = record_queue.read_records(
        record_queue.queue_path(queue_dir, run_id), 0, 1
    )
    return int(header[4])


def sockets(pid: int) -> int:
    """Sockets the process holds open (its users' connections and its upstream ones)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def stream(url: str, user: str, tokens: int, started: threading.Barrier | None) -> tuple[str | None, bool]:
    """One streamed request: (its X-Request-Id, whether the client read its response to the end)."""
    rid = None
    try:
        with httpx.Client(timeout=120) as client:
            with client.stream(
                "POST",
                url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                json={
                    "model": "ttft-opt",
                    "messages": [{"role": "user", "content": "Tell me a story"}],
                    "user": user,
                    "max_tokens": tokens,
                    "stream": True,
                },
            ) as response:
                rid = response.headers.get("x-request-id")
                lines = response.iter_lines()
                first = next(lines, None)
                if started is not None:
                    started.wait(60)
                if response.status_code != 200 or first is None:
                    return rid, False
                for _line in lines:
                    pass
        return rid, True
    except (httpx.HTTPError, threading.BrokenBarrierError):
        return rid, False


@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
def test_two_gateway_processes_one_killed_mid_stream_lose_and_double_no_completed_request(
    etcd_weights, settings, sample_store, document, users, tmp_path
):
    sim = start_in_thread("default", model="tiny-llama")  # ~15 ms a token: streams last seconds
    child = None
    spool = str(tmp_path / "spool")
    try:
        for v in document["variants"]:
            v["endpoint"], v["api"] = sim.url + "/v1", "chat"
        experiment = services.apply_document(document, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        child, url = start_gateway_command(settings, tmp_path, "--workers", "2")
        queue_dir = record_queue.queue_dir(spool)
        wait_until(lambda: len(record_queue.queue_files(queue_dir)[0]) == 2, "both processes recording", 60)
        workers = [writer_pid(queue_dir, run_id) for run_id in record_queue.queue_files(queue_dir)[0]]
        assert sorted(workers) == sorted(set(workers) & set(children(child.pid))), workers

        results: list[tuple[str | None, bool]] = []
        with ThreadPoolExecutor(STREAMS) as pool:
            # a first wave ends whole on both processes
            results += pool.map(lambda i: stream(url, f"u-{i}", 20, None), range(STREAMS))
            # the second is cut on one of them: killed once every stream has its first event
            started = threading.Barrier(STREAMS + 1)
            wave = [pool.submit(stream, url, f"u-{i}", 300, started) for i in range(STREAMS)]
            started.wait(60)
            victim = max(workers, key=sockets)  # the one holding more of the streams
            os.kill(victim, signal.SIGKILL)
            results += [f.result(timeout=120) for f in wave]
            # and the address still answers (the other process, or uvicorn's new one)
            results += pool.map(lambda i: stream(url, f"v-{i}", 10, None), range(STREAMS))
        child.send_signal(signal.SIGTERM)  # drains and closes the other process's recording
        child.communicate(timeout=90)
        # the host's recorder drains every queue file, the killed process's too
        wait_until(lambda: not record_queue.queue_files(queue_dir)[0], "every queue file drained", 120)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        sim.stop()
        stop_recorder(spool)

    complete = {rid for rid, ok in results if ok}
    cut = {rid for rid, ok in results if not ok}
    assert len(complete) + len(cut) == 3 * STREAMS and None not in complete
    assert cut, "the kill cut no stream: it came after the second wave ended"
    assert len(complete) >= 2 * STREAMS  # the first and last waves whole

    per_request = dict(
        sample_store.query("SELECT request_id, count() FROM samples WHERE mode = 'live' GROUP BY request_id")
    )
    assert all(n == 1 for n in per_request.values()), {k: n for k, n in per_request.items() if n != 1}
    assert complete <= set(per_request), complete - set(per_request)  # none lost
    assert set(per_request) <= complete | cut  # only requests that were sent

    runs = list(LiveRun.objects.all())
    assert len(runs) >= 3  # the two processes' runs, and one of the process uvicorn started again
    assert {r.status for r in runs} == {LiveRun.Status.CLOSED}
    assert all(r.recorded == r.stored + r.spooled and r.dropped == 0 and r.rejected == 0 for r in runs)
    assert sum(r.recorded for r in runs) == len(per_request)
    [(stored_rows,)] = sample_store.query("SELECT count() FROM samples WHERE mode = 'live'")
    assert stored_rows == len(per_request)
