"""Child servers (simulators, vLLM): start one, wait until it is healthy, stop it, and make sure
it dies with the process that started it.

The one place that starts server subprocesses: ``simulator.serve.start_subprocess`` and
``serving.vllm.start`` both come through ``start``.

Dying with the parent *process*. The kernel's ``PR_SET_PDEATHSIG`` sends the child a signal
when its parent dies, even by SIGKILL, so no server is left behind. But "parent" there is the
*thread* that forked the child: a child started from a short-lived thread (a thread pool's
worker) is signalled the moment that thread ends, while the process that wanted it runs on.
So every child is forked by one spawner thread that lives as long as the process (a daemon
thread blocked on its queue, never ending before the process does): the signal then fires
exactly when the process dies, whichever thread asked for the child.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port free on ``host`` right now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Dying with the parent process
# ---------------------------------------------------------------------------------------------


def _resolve_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc: children are stopped by their handles only
        return None


_PRCTL = _resolve_prctl()  # resolved here, not in the child: no dlopen between fork and exec
_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        if _PRCTL is None:
            return
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent may have died between fork and prctl: the signal would never come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class _Spawner:
    """One daemon thread per process that forks every child (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="abplat-child-spawner", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller, never kills the spawner
                    future.set_exception(exc)

    def run(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is self.thread:
            return fn()
        future: Future = Future()
        self._jobs.put((fn, future))
        return future.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _the_spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        # A forked process has no spawner thread (only the forking thread survives a fork).
        if _spawner is None or _spawner.pid != os.getpid() or not _spawner.thread.is_alive():
            _spawner = _Spawner()
        return _spawner


def spawn(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kwargs)`` forked by the process's spawner thread, with
    SIGTERM from the kernel when this process dies (Linux; elsewhere stop it by its handle)."""
    if "preexec_fn" in popen_kwargs:
        raise TypeError("spawn sets preexec_fn itself")
    preexec = _die_with(os.getpid())
    return _the_spawner().run(lambda: subprocess.Popen(list(argv), preexec_fn=preexec, **popen_kwargs))


# ---------------------------------------------------------------------------------------------
# Health, stop, and the child handle
# ---------------------------------------------------------------------------------------------


class ChildExited(RuntimeError):
    """The child exited before it was healthy."""


def _healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    *,
    name: str = "server",
    poll_s: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> None:
    """Return once GET ``url``/health answers 200; raise ``ChildExited`` as soon as ``proc`` (if
    given) exits, and RuntimeError after ``timeout_s``. ``detail()`` is appended to either
    message (e.g. the child's log tail)."""
    deadline = time.monotonic() + timeout_s
    last = ""

    def more() -> str:
        return detail() if detail is not None else ""

    while True:
        if proc is not None and proc.poll() is not None:
            raise ChildExited(f"{name} for {url} exited with code {proc.returncode}{more()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{name} at {url} not healthy after {timeout_s:g}s ({last}){more()}")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, timeout_s: float = 10.0, *, group: bool = False) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; reaped either way. ``group``: signal the
    child's whole process group (a child started with its own session that runs children of its
    own, as vLLM runs its engine core)."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


@dataclasses.dataclass
class Child:
    """A started, healthy child server."""

    url: str  # base URL, without /v1
    proc: subprocess.Popen
    group: bool = False  # stop() signals its whole process group

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        stop(self.proc, timeout_s, group=self.group)


def start(
    argv: Sequence[str],
    url: str,
    *,
    ready_s: float,
    name: str = "server",
    env: Mapping[str, str] | None = None,
    stdout: Any = subprocess.DEVNULL,
    stderr: Any = None,
    own_group: bool = False,
    poll_s: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> Child:
    """Start ``argv`` (which serves ``url``) as a child that dies with this process, and return
    once ``url``/health is 200. RuntimeError at once if another server already answers there;
    on early exit or timeout the child is killed and the error (see ``wait_healthy``) raised.
    ``own_group``: a new session, so ``stop`` reaches the child's own children too."""
    if _healthy(url):
        # Another server holds the port: its /health would pass for the child, which then dies
        # at bind.
        raise RuntimeError(f"{name}: something already serves {url}")
    proc = spawn(
        argv,
        env=None if env is None else dict(env),
        stdout=stdout,
        stderr=stderr,
        start_new_session=own_group,
    )
    child = Child(url, proc, own_group)
    try:
        wait_healthy(url, ready_s, proc, name=name, poll_s=poll_s, detail=detail)
    except BaseException:
        child.stop(5.0)
        raise
    return child
