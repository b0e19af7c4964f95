"""End to end: traffic replayed through simulators (eager Celery, real etcd, the ClickHouse
server), the controller looking after each batch. A healthy candidate reaches 100%; one whose
latency degrades partway (its simulator replaced by a slower profile on the same port) is
rolled back, and the weights store, the audit and the webhook say why."""

from __future__ import annotations

import dataclasses
import io
from urllib.parse import urlsplit

import pytest
from django.core.management import call_command

from experiments import services
from experiments.models import AuditEntry
from experiments.weights.process import live_router, weights_store
from rollouts import controller as c
from rollouts import service
from simulator.profiles import get_profile
from simulator.serve import start_in_thread
from tests.workers.background import wait_for

pytestmark = pytest.mark.engine

KEY = "rollout-demo"
TRACE = "data/traces/azure_llm_2023_code.csv"
BATCH = 300  # requests per replay between looks: ~30 on the candidate at 10%
MAX_LOOKS = 8  # a bound that stops a broken test; the assertions say how many were needed


@pytest.fixture
def sims():
    handles = {name: start_in_thread("fast", model="tiny-llama") for name in ("fp16", "awq-fa2")}
    yield handles
    for h in handles.values():
        h.stop()


def start(doc, sims, receiver):
    for v in doc["variants"]:
        v["endpoint"] = sims[v["key"]].url + "/v1"
    # Loose enough that "fast" meets it on a loaded 2-core CI machine.
    doc["sla"]["ttft_ms"] = 500
    doc["rollout"].update(min_samples=20, notify=[receiver.url])
    exp = services.apply_document(doc).experiment
    services.transition(exp, "start")


def replay_batch(seed: int) -> None:
    """One replay of BATCH requests under the weights now in the store."""
    revision = weights_store().get(KEY)[1]
    wait_for(lambda: live_router().document(KEY)[1] >= revision, timeout=10)
    out = io.StringIO()
    call_command(
        "replay",
        KEY,
        "--trace",
        TRACE,
        "--arrival",
        "poisson",
        "--rate",
        "150",
        "--limit",
        str(BATCH),
        "--seed",
        str(seed),
        "--no-preflight",
        stdout=out,
    )
    assert f"done: {BATCH}/{BATCH} samples" in out.getvalue(), out.getvalue()


def look_until_decided(seed: int) -> tuple[service.LookResult, int]:
    """Replay batches and look after each until the controller does more than hold."""
    for i in range(MAX_LOOKS):
        replay_batch(seed + i)
        r = service.look(KEY, interval_s=0)
        if r.decision.action != c.HOLD:
            return r, i + 1
    raise AssertionError(f"no decision after {MAX_LOOKS} batches: {r.note}")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("weights_backend", ["etcd"], indirect=True)
def test_a_healthy_candidate_reaches_100(weights_backend, ch_store, rollout_document, sims, receiver):
    start(rollout_document, sims, receiver)
    assert service.look(KEY, interval_s=0).decision.action == c.START
    promoted, _ = look_until_decided(seed=1)
    assert promoted.decision.action == c.PROMOTE and promoted.percent == 50, promoted.note
    done, _ = look_until_decided(seed=100)
    assert done.decision.action == c.COMPLETE and done.status == c.COMPLETED, done.note
    assert dict(weights_store().get(KEY)[0].weights) == {"fp16": 0, "awq-fa2": 100}
    assert "complete" in [b["action"] for b in receiver.bodies]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("weights_backend", ["etcd"], indirect=True)
def test_a_candidate_that_degrades_partway_is_rolled_back(
    weights_backend, ch_store, rollout_document, sims, receiver
):
    start(rollout_document, sims, receiver)
    service.look(KEY, interval_s=0)
    promoted, _ = look_until_decided(seed=1)
    assert promoted.decision.action == c.PROMOTE and promoted.percent == 50, promoted.note

    # The candidate degrades: same port, a profile whose first token takes over 1.5 s.
    port = urlsplit(sims["awq-fa2"].url).port
    sims["awq-fa2"].stop()
    slow = dataclasses.replace(get_profile("fast"), name="degraded", prefill_base_ms=1500.0)
    sims["awq-fa2"] = start_in_thread(slow, port=port, model="tiny-llama")

    r, batches = look_until_decided(seed=200)
    assert r.decision.action == c.ROLLBACK and r.status == c.ROLLED_BACK, r.note
    assert batches == 1, f"rolled back only after {batches} batches"  # the first look after it
    assert dict(weights_store().get(KEY)[0].weights) == {"fp16": 100, "awq-fa2": 0}
    entry = AuditEntry.objects.get(experiment_key=KEY, action="rollout_rollback")
    assert "step 2/3 (50%)" in entry.reason and "attainment" in entry.reason
    body = receiver.bodies[-1]
    assert body["action"] == "rollback" and body["percent"] == 0
    breached = [ch["metric"] for ch in body["numbers"]["verdict"]["checks"] if ch["status"] == "breach"]
    assert "attainment" in breached
