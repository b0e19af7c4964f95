"""serve_variant and the engine-flag allowlist, and the endpoint it writes back (audited, never
moved under a running experiment)."""

from __future__ import annotations

import dataclasses

import pytest
from django.core.management import CommandError, call_command

from experiments import services
from experiments.models import AuditEntry, Variant

pytestmark = pytest.mark.django_db


def set_engine_args(experiment, variant: str, args: dict) -> None:
    Variant.objects.filter(experiment=experiment, key=variant).update(engine_args=args)


@dataclasses.dataclass
class FakeProc:
    def wait(self):
        return 0


@dataclasses.dataclass
class FakeServer:
    url: str
    proc: FakeProc = dataclasses.field(default_factory=FakeProc)
    stopped: bool = False

    def stop(self):
        self.stopped = True


@pytest.fixture
def fake_vllm(monkeypatch):
    """serving.vllm.start without vLLM: records its calls, 'serves' at the host and port asked."""
    calls = []

    def start(launcher, model, port, *, host="127.0.0.1", **kwargs):
        calls.append({"model": model, "port": port, "host": host, **kwargs})
        return FakeServer(f"http://{host}:{port}")

    monkeypatch.setattr("serving.vllm.start", start)
    return calls


def test_a_risky_flag_is_not_served_without_the_operators_option(experiment, capsys):
    set_engine_args(experiment, "awq", {"quantization": "awq", "trust_remote_code": True})
    with pytest.raises(CommandError) as info:
        call_command("serve_variant", experiment.key, "awq", "--port", "8123", "--dry-run")
    message = str(info.value)
    assert message.startswith("variant ttft-opt/awq: engine_args.trust_remote_code:")
    assert "--allow-risky-engine-args trust-remote-code" in message
    call_command(
        "serve_variant",
        experiment.key,
        "awq",
        "--port",
        "8123",
        "--dry-run",
        "--allow-risky-engine-args",
        "trust-remote-code",
    )
    assert "--trust-remote-code" in capsys.readouterr().out


def test_a_flag_outside_the_allowlist_is_never_served(experiment, fake_vllm):
    # Stored before the allowlist existed (or written around the API): refused at serve time.
    set_engine_args(experiment, "awq", {"worker_extension_cls": "evil.Extension"})
    with pytest.raises(CommandError) as info:
        call_command("serve_variant", experiment.key, "awq", "--allow-risky-engine-args", "trust-remote-code")
    message = str(info.value)
    assert "variant ttft-opt/awq" in message and "--worker-extension-cls is not an engine flag" in message
    assert "Allowed: " in message and "max-num-seqs" in message
    assert fake_vllm == []


def test_the_operators_option_rejects_what_is_not_a_risky_flag(experiment):
    with pytest.raises(CommandError, match="--allow-risky-engine-args: --worker-cls is not a risky"):
        call_command(
            "serve_variant", experiment.key, "awq", "--dry-run", "--allow-risky-engine-args", "worker-cls"
        )


@pytest.mark.engine
def test_the_endpoint_is_recorded_through_the_audited_path(experiment, fake_vllm):
    call_command("serve_variant", experiment.key, "awq", "--port", "8177")
    assert fake_vllm[0]["allow_risky"] == frozenset() and fake_vllm[0]["port"] == 8177
    assert Variant.objects.get(experiment=experiment, key="awq").endpoint == "http://127.0.0.1:8177/v1"
    entry = AuditEntry.objects.get(action="update")
    assert entry.actor_name == "serve_variant" and "ttft-opt/awq" in entry.reason
    awq = {v["key"]: v for v in entry.before["variants"]}["awq"]
    assert awq["endpoint"] == "http://127.0.0.1:8101/v1"
    assert {v["key"]: v for v in entry.after["variants"]}["awq"]["endpoint"] == "http://127.0.0.1:8177/v1"


def test_a_running_experiments_endpoint_does_not_move(experiment, users, fake_vllm):
    services.transition(experiment, "start", users["product"])
    audited = AuditEntry.objects.count()
    with pytest.raises(CommandError, match="is running and its endpoint is http://127.0.0.1:8101/v1"):
        call_command("serve_variant", experiment.key, "awq", "--port", "8177")
    assert fake_vllm == []  # refused before starting vLLM
    assert Variant.objects.get(experiment=experiment, key="awq").endpoint == "http://127.0.0.1:8101/v1"
    # Restarting vLLM on the endpoint the variant already has changes nothing.
    call_command("serve_variant", experiment.key, "awq", "--port", "8101")
    assert len(fake_vllm) == 1 and AuditEntry.objects.count() == audited
