"""Fixtures for the capacity tests: the real weights stores and a sample store on the real
ClickHouse server, as the rollout tests use them; a simulator with a known saturation point and
an evenly spaced trace to search it with (test_capacity_command.py says why 40 req/s)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from serving.children import free_port, spawn, wait_healthy
from tests.rollouts.conftest import ch_store  # noqa: F401  (fixture)
from tests.split.conftest import etcd_endpoints, private_etcd, weights_backend  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]

ENGINES = 2
# the "saturating" profile: two 25 ms steps a request, one at a time per engine
SATURATION_RPS = ENGINES * 1000.0 / (2 * 25.0)


@pytest.fixture(scope="module")
def edge_sim():
    """The simulator in a process of its own, so the replay's client in this process does not
    slow its clock (both would share one interpreter lock)."""
    port = free_port()
    proc = spawn(
        [
            sys.executable,
            "manage.py",
            "simulator",
            "--profile",
            "saturating",
            "--port",
            str(port),
            "--model",
            "tiny-llama",
            "--replicas",
            str(ENGINES),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30, proc)
        yield types.SimpleNamespace(url=url)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "even.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": i * 0.1, "prompt": "Say two words.", "max_tokens": 2}) + "\n"
            for i in range(600)
        )
    )
    return path
