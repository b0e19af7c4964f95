"""Run simulators on uvicorn: several profiles on several ports in one process, or one in a
background thread / subprocess with a handle that knows when it is ready."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import threading
import time

import uvicorn

from serving import children
from serving.children import HOST, free_port
from simulator.app import MAX_LOGPROBS, SimulatorApp
from simulator.latency import Profile
from simulator.profiles import get_profile
from simulator.tokens import DEFAULT_TOKENIZER, check

DEFAULT_MODEL = "abplat-sim"


def parse_serve_pair(text: str) -> tuple[str, int]:
    """'NAME=PORT' -> (NAME, PORT), with a clear error naming what is wrong."""
    name, sep, port = text.partition("=")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--serve {text!r}: expected PROFILE=PORT, e.g. fp16=8101")
    get_profile(name)
    return name, int(port)


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def build_server(
    profile: str | Profile,
    model: str = DEFAULT_MODEL,
    replicas: int = 1,
    tokenizer: str = DEFAULT_TOKENIZER,
    max_logprobs: int = MAX_LOGPROBS,
) -> uvicorn.Server:
    prof = profile if isinstance(profile, Profile) else get_profile(profile)
    app = SimulatorApp(prof, model=model, replicas=replicas, tokenizer=tokenizer, max_logprobs=max_logprobs)
    config = uvicorn.Config(
        app,
        http="httptools",
        loop="uvloop",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
        backlog=4096,
    )
    return uvicorn.Server(config)


async def serve_many(
    pairs: list[tuple[str, int]] | list[tuple[str, int, str]],
    model: str = DEFAULT_MODEL,
    replicas: int = 1,
    tokenizer: str = DEFAULT_TOKENIZER,
    max_logprobs: int = MAX_LOGPROBS,
) -> None:
    """Serve each (profile, port) on 127.0.0.1 from this one event loop until interrupted; a
    (profile, port, model) triple serves that model there instead of ``model``. ValueError
    names a port that is taken."""
    if not pairs:
        raise ValueError("serve_many: no PROFILE=PORT pairs given")
    endpoints = [(p[0], p[1], p[2] if len(p) > 2 else model) for p in pairs]
    servers = []
    try:
        for name, port, served in endpoints:
            server = build_server(name, served, replicas, tokenizer, max_logprobs)
            servers.append((server, _bind_or_say(port)))
    except BaseException:
        for _, sock in servers:
            sock.close()
        raise
    for (name, port, served), _ in zip(endpoints, servers):
        print(f"simulator profile={name} model={served} at http://{HOST}:{port}", flush=True)
    await asyncio.gather(*(srv.serve(sockets=[sock]) for srv, sock in servers))


def _bind_or_say(port: int) -> socket.socket:
    try:
        return _bind(port)
    except OSError as exc:
        raise ValueError(
            f"cannot listen on {HOST}:{port}: {exc.strerror} (is another simulator, or make demo, still serving there?)"
        ) from None


def run_forever(
    pairs: list[tuple[str, int]] | list[tuple[str, int, str]],
    model: str = DEFAULT_MODEL,
    replicas: int = 1,
    tokenizer: str = DEFAULT_TOKENIZER,
    max_logprobs: int = MAX_LOGPROBS,
) -> None:
    import uvloop

    uvloop.run(serve_many(pairs, model, replicas, tokenizer, max_logprobs))


@dataclasses.dataclass
class Handle:
    url: str
    profile: str
    model: str
    _stop: object
    pid: int | None = None  # the serving process, when it is a child (start_subprocess)

    def stop(self) -> None:
        self._stop()  # type: ignore[operator]


def start_in_thread(
    profile: str | Profile = "default",
    port: int = 0,
    model: str = DEFAULT_MODEL,
    ready_s: float = 10.0,
    replicas: int = 1,
    tls: tuple[str, str] | None = None,
    tokenizer: str = DEFAULT_TOKENIZER,
    max_logprobs: int = MAX_LOGPROBS,
) -> Handle:
    """Serve in a daemon thread with its own event loop; port 0 picks a free port.
    tls=(certfile, keyfile) serves https (HTTP/1.1) instead of plain http. tokenizer: the
    prompt-length rule (simulator/tokens.py); max_logprobs: vLLM's --max-logprobs."""
    server = build_server(profile, model, replicas, tokenizer, max_logprobs)
    sock = _bind(port)
    real_port = sock.getsockname()[1]
    if tls is not None:
        server.config.ssl_certfile, server.config.ssl_keyfile = tls
    name = profile.name if isinstance(profile, Profile) else profile
    server.config.loop = "asyncio"  # uvloop in a side thread works, but keep the thread simple
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])),
        name=f"simulator-{name}-{real_port}",
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + ready_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"simulator {name!r} on port {real_port} did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    scheme = "https" if tls is not None else "http"
    return Handle(f"{scheme}://{HOST}:{real_port}", name, model, stop)


def start_subprocess(
    profile: str = "default",
    port: int = 0,
    model: str = DEFAULT_MODEL,
    ready_s: float = 20.0,
    replicas: int = 1,
    tokenizer: str = DEFAULT_TOKENIZER,
    max_logprobs: int = MAX_LOGPROBS,
) -> Handle:
    """Serve in a child process (its own core: what benchmarks need); ready when /health is.
    The child dies with this process, whichever thread started it (serving.children)."""
    get_profile(profile)
    check(tokenizer)
    port = port or free_port()
    cmd = [sys.executable, "-m", "simulator", "--port", str(port), "--profile", profile]
    cmd += ["--model", model, "--replicas", str(replicas), "--tokenizer", tokenizer]
    cmd += ["--max-logprobs", str(max_logprobs)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = children.start(cmd, f"http://{HOST}:{port}", ready_s=ready_s, name="simulator", env=env)
    return Handle(child.url, profile, model, child.stop, child.pid)
