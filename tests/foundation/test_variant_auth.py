"""Variant credentials by name: ``auth: {secret: NAME}`` keeps the NAME; the value,
read from ABPLAT_VARIANT_SECRETS_DIR, reaches the variant as its Authorization and nothing
else: not the database, the audit log, an export, the API or a log line."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest
from django.core.management import call_command

from experiments import services
from experiments.models import AuditEntry, Variant
from streaming.result import Outcome
from workers import preflight
from workers import variants as variant_clients
from workers.models import ReplayRun

TOKEN = "sk-test-9f8e7d6c5b4a3210"
TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.fixture
def secrets_dir(settings, tmp_path):
    directory = tmp_path / "secrets"
    directory.mkdir()
    (directory / "vllm-key").write_text(TOKEN + "\n")
    # The operator's binding: the simulators' host, any team (tests/foundation/test_secret_bindings.py).
    (directory / "_bindings.json").write_text('{"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["*"]}}')
    settings.VARIANT_SECRETS_DIR = str(directory)
    return directory


@pytest.fixture
def with_secret(document, recording_sim, secrets_dir, client_for):
    """The test document through the API, every variant on the recording simulator and the
    control naming the secret."""
    sim, _ = recording_sim
    for v in document["variants"]:
        v["endpoint"], v["api"] = sim.url + "/v1", "chat"
    document["variants"][0]["auth"] = {"secret": "vllm-key"}
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 201, response.json()
    # With its experiment's team (the secret's binding names teams): the tests below build the
    # clients inside an event loop, where no query may run, as a shard's variants come loaded.
    return Variant.objects.select_related("experiment__team").get(key="fp16")


def _everything_kept(client_for) -> str:
    """All the platform keeps or shows about experiments: every table, the exports, the API."""
    out = io.StringIO()
    call_command("dumpdata", stdout=out)
    call_command("export_experiment", "ttft-opt", stdout=out)
    call_command("export_experiment", "ttft-opt", "--format", "json", stdout=out)
    api = client_for("analyst")
    out.write(api.get("/api/experiments/ttft-opt/").content.decode())
    out.write(api.get("/api/experiments/ttft-opt/audit/").content.decode())
    return out.getvalue()


@pytest.mark.django_db
@pytest.mark.engine
def test_only_the_secret_name_is_stored_audited_and_exported(with_secret, client_for):
    assert with_secret.auth_secret == "vllm-key"
    audit = AuditEntry.objects.get(action="create")
    assert audit.after["variants"][0]["auth"] == {"secret": "vllm-key"}
    exported = services.export_document(with_secret.experiment)
    assert exported["variants"][0]["auth"] == {"secret": "vllm-key"}
    assert exported["variants"][1]["auth"] is None
    assert services.apply_document(exported).changes == []  # the export applies unchanged
    kept = _everything_kept(client_for)
    assert "vllm-key" in kept and TOKEN not in kept


@pytest.mark.django_db
def test_the_secret_reaches_the_variant_from_client_probe_and_preflight(
    with_secret, recording_sim, client_for, caplog
):
    _, seen = recording_sim
    caplog.set_level(logging.DEBUG)
    variants = list(with_secret.experiment.variants.order_by("position"))

    async def stream_and_count():
        client = variant_clients.client_for(with_secret)
        try:
            result = await client.stream("r-1", "hello", 4)
        finally:
            await client.aclose()
        counter, why = await variant_clients.counter_for(variants)(
            with_secret.endpoint, with_secret.model, with_secret.api
        )
        assert counter is not None, why
        await counter.aclose()
        return result

    result = asyncio.run(stream_and_count())
    assert result.outcome is Outcome.OK, result.error
    problems = preflight.check(
        [preflight.Target(v.key, v.endpoint, v.model, v.http2, v.auth_secret) for v in variants]
    )
    assert problems == []
    bearer = f"Bearer {TOKEN}"
    paths = {path for path, auth in seen if auth == bearer}
    assert paths == {"/v1/chat/completions", "/tokenize", "/v1/models"}
    # The variants without a secret send no Authorization at all.
    assert sum(1 for _, auth in seen if auth == "") == 2  # preflight of awq and awq-fa2
    assert TOKEN not in caplog.text and TOKEN not in _everything_kept(client_for)


@pytest.mark.django_db
def test_a_secret_that_is_not_configured_fails_the_preflight_naming_variant_and_secret(
    with_secret, secrets_dir, recording_sim
):
    _, seen = recording_sim
    Variant.objects.filter(pk=with_secret.pk).update(auth_secret="other-key")
    (secrets_dir / "vllm-key").unlink()
    variants = list(with_secret.experiment.variants.order_by("position"))
    problems = preflight.check(
        [preflight.Target(v.key, v.endpoint, v.model, v.http2, v.auth_secret) for v in variants]
    )
    assert problems == [
        "variant 'fp16': secret 'other-key' is not configured (no file of that name in ABPLAT_VARIANT_SECRETS_DIR)"
    ]
    assert not any(path == "/v1/models" and auth for path, auth in seen)  # fp16 was not probed


@pytest.mark.django_db
def test_the_preflight_refuses_a_variant_the_allowlist_no_longer_covers(with_secret, settings):
    settings.VARIANT_ALLOWED_HOSTS = ["localhost"]  # 127.0.0.1 is not on it any more
    variants = list(with_secret.experiment.variants.order_by("position"))
    problems = preflight.check(
        [preflight.Target(v.key, v.endpoint, v.model, v.http2, v.auth_secret) for v in variants]
    )
    assert len(problems) == 3
    assert problems[0].startswith("variant 'fp16': ") and "outside the variant allowlist" in problems[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.engine
def test_a_replay_sends_the_secret_and_records_no_trace_of_it(
    with_secret, recording_sim, sample_store, users, capfd, caplog
):
    _, seen = recording_sim
    caplog.set_level(logging.DEBUG)
    services.transition(with_secret.experiment, "start", users["product"])
    out = io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        TRACE,
        "--limit",
        "12",
        "--speed",
        "200",
        "--mode",
        "mirror",
        stdout=out,
    )
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out.getvalue())
    sent = [auth for path, auth in seen if path == "/v1/chat/completions"]
    assert len(sent) == 36 and sent.count(f"Bearer {TOKEN}") == 12  # the control's share
    rows = sample_store.query("SELECT * FROM samples WHERE run_id = %(r)s", {"r": run.pk})
    captured = capfd.readouterr()
    assert TOKEN not in repr(rows) and TOKEN not in caplog.text and TOKEN not in captured.out + captured.err


def test_the_preflight_refuses_credentials_left_in_an_endpoint():
    problem = preflight.probe(preflight.Target("fp16", "http://admin:hunter2@127.0.0.1:1/v1", "m"))
    assert problem.startswith("variant 'fp16': endpoint must not carry credentials")
    assert "hunter2" not in problem
