"""Child servers die with the process that started them, not the thread (serving/children.py).

(a) A child started from a short-lived thread outlives that thread: PR_SET_PDEATHSIG fires when
    the starting *thread* ends, and bench_replay started its simulators from a thread pool.
(b) A parent process killed with SIGKILL (no cleanup code runs) leaves no orphan server.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from simulator.serve import start_subprocess

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import sys, time
from simulator.serve import start_subprocess
h = start_subprocess("fast")
print(h.pid, h.url, flush=True)
time.sleep(120)
"""

# The same, with the child started from a pool thread that has ended before the SIGKILL.
PARENT_FROM_POOL = """
import concurrent.futures, sys, time
from simulator.serve import start_subprocess
with concurrent.futures.ThreadPoolExecutor(1) as pool:
    h = pool.submit(start_subprocess, "fast").result()
print(h.pid, h.url, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.process
def test_a_child_started_from_an_ended_pool_thread_stays_up():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        handles = list(pool.map(lambda _: start_subprocess("fast"), range(2)))
    # the pool's threads have exited here
    try:
        time.sleep(0.5)  # the kernel's SIGTERM, had it been sent, has landed by now
        for h in handles:
            assert alive(h.pid) and healthy(h.url), f"simulator {h.pid} died with its starting thread"
    finally:
        for h in handles:
            h.stop()
    for h in handles:
        assert not alive(h.pid)


@pytest.mark.parametrize("script", [PARENT, PARENT_FROM_POOL], ids=["main-thread", "pool-thread"])
@pytest.mark.process
def test_a_killed_parent_takes_its_simulator_with_it(script):
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        pid_text, url = parent.stdout.readline().split()
        child = int(pid_text)
        assert alive(child) and url.startswith("http://127.0.0.1:")
        assert healthy(url)
        parent.send_signal(signal.SIGKILL)  # no cleanup code runs in the parent
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"simulator {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.process
def test_a_child_that_exits_early_is_reported_at_once():
    from serving import children

    url = f"http://127.0.0.1:{children.free_port()}"
    t0 = time.monotonic()
    with pytest.raises(children.ChildExited, match=r"exited with code 3.*tail: boom"):
        children.start(
            [sys.executable, "-c", "import sys; sys.exit(3)"], url, ready_s=30, detail=lambda: "; tail: boom"
        )
    assert time.monotonic() - t0 < 10  # not the 30 s deadline


@pytest.mark.process
def test_a_child_never_healthy_is_stopped_at_the_deadline(tmp_path):
    from serving import children

    url = f"http://127.0.0.1:{children.free_port()}"
    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(RuntimeError, match="not healthy after 1s"):
        children.start([sys.executable, "-c", script], url, ready_s=1, stdout=subprocess.PIPE)
    # The stopped child is reaped by start: no server, no zombie (a zombie still answers kill 0).
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.process
def test_stop_reaches_the_childs_own_children_when_it_has_its_own_group():
    # As vLLM runs an engine-core process: stop(group=True) signals the whole process group.
    from serving import children

    script = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = children.spawn(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = int(proc.stdout.readline())
    children.stop(proc, 5, group=True)
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode is not None and not alive(grandchild)


@pytest.mark.process
def test_a_port_another_server_answers_on_is_refused_not_mistaken_for_the_child():
    first = start_subprocess("fast")
    try:
        port = int(first.url.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError, match="already serves"):
            start_subprocess("fast", port=port)
        assert healthy(first.url)
    finally:
        first.stop()
