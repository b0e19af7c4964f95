"""Variants served over TLS by a private CA: the replay trusts exactly the bundle named in
ABPLAT_VARIANT_CA_BUNDLE, and without it every request is a certificate failure, recorded."""

import io

import pytest
from django.core.management import CommandError, call_command

from experiments import services
from simulator.serve import start_in_thread
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.fixture(scope="module")
def tls_sims(pki):
    handles = {
        name: start_in_thread("fast", model="tiny-llama", tls=(pki.certfile, pki.keyfile))
        for name in ("fp16", "awq", "awq-fa2")
    }
    yield handles
    for h in handles.values():
        h.stop()


@pytest.fixture
def running_tls(db, document, tls_sims, users, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system store must not know the CA
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    for v in document["variants"]:
        assert tls_sims[v["key"]].url.startswith("https://")
        v["endpoint"] = tls_sims[v["key"]].url + "/v1"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment


def _replay(*args) -> ReplayRun:
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        TRACE,
        "--limit",
        "30",
        "--speed",
        "200",
        "--mode",
        "mirror",
        *args,
        stdout=io.StringIO(),
    )
    return ReplayRun.objects.latest("pk")


@pytest.mark.django_db(transaction=True)
def test_replay_trusts_the_configured_ca_bundle(running_tls, sample_store, settings, pki):
    settings.VARIANT_CA_BUNDLE = pki.ca
    run = _replay()
    assert run.status == "done" and run.samples_recorded == 90
    assert run.outcomes == {"ok": 90}


@pytest.mark.django_db(transaction=True)
def test_without_the_bundle_every_request_is_a_recorded_certificate_failure(
    running_tls, sample_store, settings
):
    settings.VARIANT_CA_BUNDLE = ""
    # The preflight refuses an untrusted certificate up front, naming the variant...
    with pytest.raises(CommandError, match="preflight failed.*CERTIFICATE_VERIFY_FAILED"):
        _replay()
    # ...and a drill that skips it records every request as the certificate failure it is.
    run = _replay("--no-preflight")
    assert run.status == "done" and run.samples_recorded == 90
    assert run.outcomes == {"connect_error": 90}
    errors = sample_store.query(
        "SELECT DISTINCT error FROM samples FINAL WHERE run_id = %(r)s", {"r": run.pk}
    )
    assert errors and all("CERTIFICATE_VERIFY_FAILED" in e for (e,) in errors), errors
