"""The management commands simulator (simulator/) and serve_variant (serving/), and the simulator CLI they
share with `python -m simulator` (simulator/cli.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from django.core.management import CommandError, call_command

from serving.children import free_port, wait_healthy
from simulator.cli import pairs_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_pairs_are_validated():
    assert pairs_from_args(8000, None, ["fp16=8001"]) == [("default", 8000), ("fp16", 8001)]
    with pytest.raises(ValueError, match="PROFILE=PORT"):
        pairs_from_args(None, None, ["fp16:8001"])
    with pytest.raises(ValueError, match="unknown simulator profile"):
        pairs_from_args(None, None, ["gpt9=8001"])
    with pytest.raises(ValueError, match="used twice"):
        pairs_from_args(8001, "awq", ["fp16=8001"])
    with pytest.raises(ValueError, match="needs --port"):
        pairs_from_args(None, "awq", [])


def test_management_command_rejects_bad_pairs():
    with pytest.raises(CommandError, match="PROFILE=PORT"):
        call_command("simulator", "--serve", "fp16")


@pytest.mark.process
def test_management_command_serves_several_profiles_from_one_process():
    p1, p2 = free_port(), free_port()
    cmd = [sys.executable, "manage.py", "simulator", "--serve", f"fp16={p1}", "--serve", f"awq-fa2={p2}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{p1}", 20, proc)
        wait_healthy(f"http://127.0.0.1:{p2}", 20, proc)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    assert b"profile=fp16" in out and b"profile=awq-fa2" in out
    time.sleep(0.1)


@pytest.mark.django_db
def test_serve_variant_dry_run_prints_the_command(experiment, capsys):
    call_command("serve_variant", experiment.key, "awq", "--port", "8123", "--dry-run")
    out = capsys.readouterr().out
    assert "--port 8123" in out and "--quantization awq" in out and "--served-model-name tiny-llama" in out


@pytest.mark.django_db
def test_serve_variant_names_a_missing_variant(experiment):
    with pytest.raises(CommandError, match="no variant 'nope'"):
        call_command("serve_variant", experiment.key, "nope", "--dry-run")
