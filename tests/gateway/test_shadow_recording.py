"""Shadow rows through the live recording path (gateway/recording.py record_shadow, the host's
recorder, gateway/shadow_store.py): stored in fidelity_shadows with the samples' guarantees, so
a store that is down spools them and a later recorder writes them; the live run's sample counts
leave them out. On chDB and on the real ClickHouse server."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from gateway.recording import LiveRecorder
from gateway.shadow_store import ShadowWriter
from samples.store import StoreUnavailable
from tests.gateway.test_recording import record, stored
from tests.samples.conftest import switch_off

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

COLUMNS = ("request_id", "variant", "compared", "outcome", "identical", "first_divergence", "variant_fp")


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)


def shadow_row(i: int, **over) -> dict:
    row = {
        "experiment": "ttft-opt",
        "variant": "awq",
        "control": "fp16",
        "request_id": f"gw-shadow-{i:04d}",
        "user_id": f"user-{i}",
        "config_revision": 3,
        "sent_at": 1_764_640_000 + i,
        "compared": "live" if i % 2 else "greedy_pair",
        "outcome": "ok",
        "error": "",
        "identical": i % 3 == 0,
        "first_divergence": -1 if i % 3 == 0 else i % 16,
        "unit": "token",
        "variant_tokens": 16,
        "control_tokens": 16,
        "variant_fp": 2**63 + i,  # UInt64 above Int64's range
        "control_fp": 2**63 + (0 if i % 3 == 0 else 10_000) + i,
    }
    row["identical"] = int(row["identical"])
    row.update(over)
    return row


def shadows_stored(store) -> list[dict]:
    got = store.query(f"SELECT {', '.join(COLUMNS)} FROM fidelity_shadows FINAL ORDER BY request_id")
    return [dict(zip(COLUMNS, r, strict=True)) for r in got]


def recorder(store, tmp_path) -> LiveRecorder:
    return LiveRecorder(
        worker="gw-test:1",
        store=store,
        spool_dir=str(tmp_path / "spool"),
        batch_rows=10,
        flush_ms=20.0,
        retry_s=0.05,
        heartbeat_s=0.05,
    )


def test_shadow_rows_are_stored_beside_the_samples_and_are_not_counted_as_samples(store, tmp_path):
    rec = recorder(store, tmp_path)
    rec.start()
    ids = []
    for i in range(6):
        ids.append(record(rec, i))
        rec.record_shadow(shadow_row(i))
    assert rec.close() is True
    rows = shadows_stored(store)
    assert [r["request_id"] for r in rows] == [f"gw-shadow-{i:04d}" for i in range(6)]
    assert (
        rows[1]["compared"] == "live"
        and rows[1]["first_divergence"] == 1
        and rows[1]["variant_fp"] == 2**63 + 1
    )
    assert rows[0]["identical"] == 1 and rows[0]["first_divergence"] == -1
    # the samples' seqs and counts are the samples' alone
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids
    assert [r["seq"] for r in stored(store, rec.run_id)] == list(range(1, 7))
    counts = rec.counts()
    assert (counts["recorded"], counts["stored"], counts["queued"], counts["rejected"]) == (6, 6, 0, 0)


def test_the_store_down_spools_shadow_rows_and_the_next_recorder_writes_them(store, tmp_path, monkeypatch):
    down = switch_off(store, monkeypatch)  # the samples' writes
    real = store.insert_fidelity_shadows

    def failing(rows):
        if down.is_set():
            raise StoreUnavailable("the store is down (test)")
        return real(rows)

    monkeypatch.setattr(store, "insert_fidelity_shadows", failing)
    down.set()
    rec = recorder(store, tmp_path)
    rec.start()
    ids = []
    for i in range(25):
        ids.append(record(rec, i))
        rec.record_shadow(shadow_row(i))
    assert rec.close() is True  # drained: every row durable in the spools, the queue file gone
    spool = os.path.join(str(tmp_path / "spool"), "fidelity_shadows")
    assert [n for n in os.listdir(spool) if n.endswith(".jsonl")]
    assert shadows_stored(store) == [] and stored(store, rec.run_id) == []

    down.clear()
    again = recorder(store, tmp_path)
    again.start()  # its recorder flushes both spools first
    again.record_shadow(shadow_row(25))
    assert again.close() is True
    assert [r["request_id"] for r in shadows_stored(store)] == [f"gw-shadow-{i:04d}" for i in range(26)]
    assert not [n for n in os.listdir(spool) if n.endswith(".jsonl")]
    assert [r["request_id"] for r in stored(store, rec.run_id)] == ids


def test_a_torn_spool_file_gives_up_its_whole_rows_and_moves_to_quarantine(store, tmp_path):
    writer = ShadowWriter(store, str(tmp_path / "spool"), pause_s=0.0)
    writer._spool([shadow_row(1), shadow_row(2)])
    [name] = writer.pending_files()
    path = os.path.join(writer.dir, name)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: data.rindex(b"\n", 0, len(data) - 1) + 20])  # the last row cut mid-line
    assert writer.retry() is True
    assert [r["request_id"] for r in shadows_stored(store)] == ["gw-shadow-0001"]
    assert writer.pending_files() == [] and os.listdir(writer.quarantine) == [name + ".torn"]


def test_a_live_shadow_reaches_the_store_through_the_gateway_s_recorder(
    store, tmp_path, running_with, settings
):
    from experiments.weights import process
    from gateway.app import Gateway
    from gateway.config import GatewayConfig
    from gateway.limits import parse_keys
    from gateway.variants import Directory
    from streaming.egress import parse_allowlist
    from tests.gateway.conftest import KEY, serve, user_on
    from tests.gateway.test_shadow import chat, diverged_at, post, with_share

    running_with(with_share(1.0))
    directory = Directory()
    directory.refresh()
    rec = recorder(store, tmp_path)
    gateway = Gateway(
        GatewayConfig(keys=parse_keys(f"acme {KEY}\n")),
        router=process.live_router(),
        directory=directory,
        recorder=rec,
        allow=parse_allowlist(["127.0.0.0/8"]),
        refresh_variants=False,
    )
    url, stop = serve(gateway)
    gw = SimpleNamespace(url=url)  # what post() needs of a served gateway
    try:
        user = user_on(process.live_router(), "ttft-opt", "awq")
        resp = post(gw, chat("Tell me about the sea", user, temperature=0))
        assert resp.status_code == 200
        truth = diverged_at(resp.content)
        deadline = time.monotonic() + 10
        while gateway.attempts.shadows.tasks or not gateway.attempts.shadows.counts:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        stop()  # the lifespan's shutdown closes the recorder: every record written
    [row] = shadows_stored(store)
    assert row["request_id"] == resp.headers["x-request-id"] and row["compared"] == "live"
    assert row["outcome"] == "ok" and row["first_divergence"] == (-1 if truth is None else truth)
    # the user's sample, and no sample of the shadow
    assert [r["request_id"] for r in stored(store, rec.run_id)] == [resp.headers["x-request-id"]]
