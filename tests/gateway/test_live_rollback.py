"""A rollout rolled back by the controller on live traffic: users' requests through the gateway
(the official client, real etcd weights, the real LiveRecorder on the ClickHouse server), the
controller looking after each batch. The candidate's first token takes 1.5 s against an SLA of
500 ms, so the first look with enough of its samples rolls it back, and the users it had are
sent to the control from then on."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from experiments import services
from experiments.models import AuditEntry
from experiments.weights import process
from experiments.weights.process import weights_store
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.limits import parse_keys
from gateway.recording import LiveRecorder
from gateway.variants import Directory
from rollouts import controller as c
from rollouts import service
from simulator.profiles import get_profile
from simulator.serve import start_in_thread
from streaming.egress import parse_allowlist
from tests.gateway.conftest import KEY as API_KEY
from tests.gateway.conftest import serve
from tests.gateway.test_weights_and_retry import wait_for_revision
from tests.rollouts.conftest import ROLLOUT_DOCUMENT, ch_store  # noqa: F401  (the fixture)
from tests.split.conftest import etcd_endpoints, weights_backend  # noqa: F401  (fixtures)
from tests.workers.background import wait_for

EXPERIMENT = ROLLOUT_DOCUMENT["key"]
BATCH = 240  # requests between looks: ~24 on the candidate at 10%
MAX_LOOKS = 6  # a bound that stops a broken test; the assertions say how many were needed


@pytest.fixture
def sims():
    slow = dataclasses.replace(get_profile("fast"), name="degraded", prefill_base_ms=1500.0)
    handles = {
        "fp16": start_in_thread("fast", model="tiny-llama"),
        "awq-fa2": start_in_thread(slow, model="tiny-llama"),
    }
    yield handles
    for h in handles.values():
        h.stop()


def stored(store) -> dict[str, int]:
    rows = store.query(
        "SELECT variant, count() FROM samples FINAL WHERE experiment = %(e)s AND mode = 'live' GROUP BY variant",
        {"e": EXPERIMENT},
    )
    return {v: int(n) for v, n in rows}


@pytest.mark.services
@pytest.mark.django_db(transaction=True)  # the recorder's and the directory's threads use the database
@pytest.mark.parametrize("weights_backend", ["etcd"], indirect=True)
@pytest.mark.engine
def test_a_rollout_is_rolled_back_by_the_controller_on_live_traffic(
    weights_backend,  # noqa: F811  (the imported fixture)
    ch_store,  # noqa: F811
    sims,
    tmp_path,
):
    import openai

    doc = {**ROLLOUT_DOCUMENT, "variants": [dict(v) for v in ROLLOUT_DOCUMENT["variants"]]}
    doc["rollout"] = {**doc["rollout"], "min_samples": 20}
    doc["sla"] = {"ttft_ms": 500, "target": 0.95}  # "fast" meets it on a loaded 2-core machine
    for v in doc["variants"]:
        v.update(endpoint=sims[v["key"]].url + "/v1", api="chat")
    experiment = services.apply_document(doc).experiment
    services.transition(experiment, "start")
    start = service.look(EXPERIMENT, interval_s=0)
    assert start.decision.action == c.START, start.note
    router = process.live_router()
    wait_for_revision(router, weights_store().get(EXPERIMENT)[1])

    directory = Directory()
    directory.refresh()
    recorder = LiveRecorder(
        worker="gateway-test", store=ch_store, spool_dir=str(tmp_path / "spool"), batch_rows=50, flush_ms=50
    )
    gateway = Gateway(
        GatewayConfig(keys=parse_keys(f"acme {API_KEY}\n")),
        router=router,
        directory=directory,
        recorder=recorder,
        allow=parse_allowlist(["127.0.0.0/8"]),
        refresh_variants=False,
    )
    url, stop = serve(gateway)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)

    def ask(user: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=EXPERIMENT, messages=[{"role": "user", "content": "hello"}], user=user, max_tokens=4
        )
        raw.parse()
        return raw.headers["x-abplat-variant"]

    sent = 0
    served: dict[str, str] = {}
    try:
        with ThreadPoolExecutor(32) as pool:
            looks = 0
            while looks < MAX_LOOKS:
                looks += 1
                users = [f"user-{sent + i}" for i in range(BATCH)]
                served.update(zip(users, pool.map(ask, users), strict=True))
                sent += BATCH
                # every answer recorded and stored before the look (nothing lost on the way)
                wait_for(lambda n=sent: sum(stored(ch_store).values()) == n, timeout=60)
                r = service.look(EXPERIMENT, interval_s=0)
                if r.decision.action != c.HOLD:
                    break
            assert r.decision.action == c.ROLLBACK and r.status == c.ROLLED_BACK, r.note
            assert looks <= 2, f"rolled back only after {looks} batches"
            assert dict(weights_store().get(EXPERIMENT)[0].weights) == {"fp16": 100, "awq-fa2": 0}
            entry = AuditEntry.objects.get(experiment_key=EXPERIMENT, action="rollout_rollback")
            assert "attainment" in entry.reason, entry.reason
            counts = stored(ch_store)
            # the candidate's users (about 10%) were served by it and judged from their samples:
            # a breach this clear rolls back before min_samples (the guardrails' own decision)
            assert 0 < counts.get("awq-fa2", 0) < counts["fp16"] and sum(counts.values()) == sent, counts

            # the users the candidate had go to the control once the router has the rollback
            wait_for_revision(router, weights_store().get(EXPERIMENT)[1])
            had = [u for u, v in served.items() if v == "awq-fa2"][:10]
            assert had and set(pool.map(ask, had)) == {"fp16"}
    finally:
        stop()
        recorder.close()
    assert sum(stored(ch_store).values()) == sent + len(had)  # every request, once
