"""The metrics themselves: names and units by Prometheus conventions, bounded labels, every one
documented and charted, and each instrumented part moving its series (in-process mode, the
embedded default; the multiprocess mode is tests/telemetry/test_multiprocess.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from experiments.weights.document import build_document
from experiments.weights.local import LocalWeightsStore
from experiments.weights.router import Router
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.rows import SampleContext, row_from
from samples.spool import SpoolingWriter
from samples.store import StoreUnavailable
from streaming.result import StreamResult
from telemetry import metrics
from tests.telemetry.conftest import parse, total

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "metrics.md").read_text()
DASHBOARD = json.loads((ROOT / "docs" / "grafana" / "abplat.json").read_text())
# Labels that would make a series per request, user or run, or could carry a secret.
FORBIDDEN_LABELS = {"run", "run_id", "request_id", "user", "user_id", "shard", "path", "url", "token", "key"}
UNITS = (
    "seconds",
    "bytes",
    "rows",
    "requests",
    "samples",
    "files",
    "flushes",
    "shards",
    "runs",
    "revision",
    "connected",
    "errors",
    "reconnects",
    "loads",
    "applied",
    "rejected",
    "requeued",
    "finished",
    "running",
    "in_flight",
    "written",
    "completed",
    "sent",
    "spooled",
    "flushed",
    "quarantined",
    "inserted",
)


def families() -> dict[str, str]:
    """{metric name as exposed (counters with _total): type} of every abplat_ metric."""
    out = {}
    for family in metrics.REGISTRY.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = family.type
    out[metrics.REPLAY_RUNS_NAME] = "gauge"
    return out


def exercised_exposition() -> str:
    """The in-process registry after every labelled metric got a child."""
    meter = metrics.ReplayMeter("conventions-exp")
    meter.sent("a")
    meter.completed("a", "ok", 0.002)
    meter.written(3, "store")
    metrics.observe_http("conventions", "GET", 200, 0.01)
    metrics.RouterMeter("conventions").synced(1)
    metrics.REPLAY_SHARDS_FINISHED.labels("done").inc(0)
    metrics.REPLAY_SHARDS_REQUEUED.labels("budget").inc(0)
    metrics.SPOOL_FLUSHES.labels("ok").inc(0)
    metrics.STORE_INSERTED_ROWS.labels("conventions").inc(0)
    metrics.STORE_INSERT_SECONDS.labels("conventions").observe(0.01)
    metrics.STORE_INSERT_ERRORS.labels("conventions", "permanent").inc(0)
    body, _ = metrics.exposition([metrics.RunStatesCollector(lambda: {"running": 1})])
    return body.decode()


def test_every_metric_is_named_and_united_by_prometheus_conventions():
    text = exercised_exposition()
    seen = set()
    for family in text_string_to_metric_families(text):
        name = family.name
        seen.add(name)
        assert re.fullmatch(r"abplat_[a-z]+(_[a-z0-9]+)+", name), name
        assert family.documentation.strip(), f"{name} has no help text"
        if family.type == "counter":
            assert all(s.name == name + "_total" for s in family.samples), family.samples
        else:
            assert not name.endswith("_total"), f"{name} is a {family.type} named like a counter"
        if family.type == "histogram":
            assert name.endswith(("_seconds", "_bytes")), f"histogram {name} names no base unit"
        # Base units only: seconds and bytes, never milli-, micro- or kilo-.
        assert not re.search(r"_(ms|us|millis|milliseconds|micros|kb|mb|kilobytes|megabytes)(_|$)", name), (
            name
        )
        assert name.removesuffix("_total").removesuffix("_timestamp_seconds").endswith(
            UNITS
        ) or name.endswith("_seconds"), f"{name}: what does it count or measure?"
        for sample in family.samples:
            assert not FORBIDDEN_LABELS & set(sample.labels), (name, sample.labels)
            assert not sample.name.endswith("_created"), "created series double the series for nothing"
    assert seen == {n.removesuffix("_total") for n in families()}


def test_every_metric_is_documented_and_the_documentation_names_no_other():
    documented = set(re.findall(r"`(abplat_[a-z0-9_]+)`", DOC))
    exposed = set(families())
    assert exposed <= documented, f"not in docs/metrics.md: {sorted(exposed - documented)}"
    series = exposed | {
        f"{n}{s}" for n, t in families().items() if t == "histogram" for s in ("_bucket", "_sum", "_count")
    }
    assert documented <= series, (
        f"docs/metrics.md names metrics that do not exist: {sorted(documented - series)}"
    )
    for name, kind in families().items():
        assert re.search(rf"`{name}`[^\n]*\b{kind}\b", DOC), (
            f"docs/metrics.md: {name} should say it is a {kind}"
        )


def dashboard_exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in dashboard_exprs(v)]
    return []


def test_the_grafana_dashboard_charts_only_metrics_that_exist():
    exprs = dashboard_exprs(DASHBOARD)
    assert len(exprs) >= 12
    series = set(families()) | {
        f"{n}{s}" for n, t in families().items() if t == "histogram" for s in ("_bucket", "_sum", "_count")
    }
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\babplat_[a-z0-9_]+", expr))
        assert names, f"an expression on no abplat metric: {expr}"
        assert names <= series, f"{expr}: no such metric {sorted(names - series)}"
        used |= {n for n in names}
    # Every family is on the dashboard (histograms through any of their series).
    charted = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in families() else n for n in used}
    assert set(families()) <= charted, f"not on the dashboard: {sorted(set(families()) - charted)}"


def test_replay_meter_counts_sends_outcomes_lag_and_writes():
    before = parse(generate_latest(metrics.REGISTRY).decode())
    meter = metrics.ReplayMeter("meter-exp")

    class Client:
        api = "chat"

        async def stream(self, request_id, prompt, max_tokens, extra=None):
            assert (
                total(
                    parse(generate_latest(metrics.REGISTRY).decode()),
                    "abplat_replay_requests_in_flight",
                    experiment="meter-exp",
                )
                == 1
            )
            return StreamResult(request_id=request_id)

        async def aclose(self):
            self.closed = True

    import asyncio

    client = meter.wrap_client("v1", Client())
    assert client.api == "chat"  # the wrapped client's attributes
    asyncio.run(client.stream("r1", "hi", 4))
    asyncio.run(client.aclose())
    assert client.inner.closed
    rows = []
    put = meter.put_row(rows.append)
    put(
        row_from(
            StreamResult(),
            SampleContext(
                experiment="meter-exp",
                run_id=1,
                seq=0,
                variant="v1",
                mode="split",
                sent_unix_ms=time.time() * 1000,
                schedule_lag_ms=30.0,
            ),
        )
    )
    meter.written(1, "spool")
    after = parse(generate_latest(metrics.REGISTRY).decode())

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert len(rows) == 1
    assert delta("abplat_replay_requests_sent_total", experiment="meter-exp", variant="v1") == 1
    assert (
        delta("abplat_replay_requests_completed_total", experiment="meter-exp", variant="v1", outcome="ok")
        == 1
    )
    assert delta("abplat_replay_requests_in_flight", experiment="meter-exp") == 0
    # 30 ms lag lands in the 0.05 s bucket, not in the 0.025 s one.
    assert delta("abplat_replay_schedule_lag_seconds_bucket", experiment="meter-exp", le="0.025") == 0
    assert delta("abplat_replay_schedule_lag_seconds_bucket", experiment="meter-exp", le="0.05") == 1
    assert delta("abplat_replay_schedule_lag_seconds_sum", experiment="meter-exp") == pytest.approx(0.03)
    assert delta("abplat_replay_samples_written_total", experiment="meter-exp", destination="spool") == 1


def test_router_exposes_revision_sync_time_reconnect_and_rejection_counts(tmp_path):
    store = LocalWeightsStore(tmp_path / "weights")
    before = parse(generate_latest(metrics.REGISTRY).decode())
    doc = build_document("m-exp", {"a": 50, "b": 50}, salt="s", control="a", actor="t", reason="start")
    revision = store.put("m-exp", doc, 0)
    router = Router(store)
    started = time.time()
    try:
        assert router.start(wait=10)
        store.put_raw("m-exp", b"{not json", revision)  # rejected: the previous document stays
        deadline = time.monotonic() + 10
        while router.metrics["documents_rejected"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        after = parse(generate_latest(metrics.REGISTRY).decode())
    finally:
        router.stop()

    def delta(name):
        return total(after, name, store="local") - total(before, name, store="local")

    assert (
        total(after, "abplat_router_snapshot_revision", store="local") == router.snapshot.revision >= revision
    )
    assert total(after, "abplat_router_last_sync_timestamp_seconds", store="local") >= started
    assert total(after, "abplat_router_watch_connected", store="local") == 1
    assert delta("abplat_router_documents_rejected_total") == 1
    assert delta("abplat_router_full_loads_total") >= 1
    assert delta("abplat_router_changes_applied_total") >= 1
    assert delta("abplat_router_watch_reconnects_total") == 0  # never dropped


class FakeStore:
    """insert_columns fails while ``down``; what the spool's flush needs otherwise."""

    def __init__(self):
        self.down, self.rows = True, []

    def prepare_for_writes(self):
        pass

    def insert_columns(self, cols):
        if self.down:
            raise StoreUnavailable("down (test)")
        self.rows += list(zip(*cols.values(), strict=True))

    def insert_samples(self, rows):
        if self.down:
            raise StoreUnavailable("down (test)")
        self.rows += list(rows)

    def existing_keys(self, keys):
        if self.down:
            raise StoreUnavailable("down (test)")
        return set()


def sample_rows(n):
    return [
        row_from(
            StreamResult(ttft_ms=5.0, e2e_ms=9.0),
            SampleContext(
                experiment="spool-exp",
                run_id=7,
                seq=i,
                variant="a",
                mode="split",
                sent_unix_ms=time.time() * 1000,
            ),
        )
        for i in range(n)
    ]


def test_spool_depth_rises_while_the_store_is_down_and_drains_with_the_flush(tmp_path):
    store = FakeStore()
    writer = SpoolingWriter(store, str(tmp_path / "spool"))
    before = parse(generate_latest(metrics.REGISTRY).decode())
    assert writer.write(sample_rows(5)) == "spooled"
    with pytest.raises(StoreUnavailable):
        writer.flush()
    down = parse(generate_latest(metrics.REGISTRY).decode())
    assert total(down, "abplat_spool_rows") == 5
    spool_file = next((tmp_path / "spool").glob("*.jsonl"))
    assert total(down, "abplat_spool_bytes") == spool_file.stat().st_size
    assert (
        total(down, "abplat_spool_spooled_rows_total") - total(before, "abplat_spool_spooled_rows_total") == 5
    )
    assert (
        total(down, "abplat_spool_flushes_total", result="store_unavailable")
        - total(before, "abplat_spool_flushes_total", result="store_unavailable")
        == 1
    )
    store.down = False
    report = writer.flush()
    up = parse(generate_latest(metrics.REGISTRY).decode())
    assert report.inserted == 5 and len(store.rows) == 5
    assert total(up, "abplat_spool_rows") == 0 and total(up, "abplat_spool_bytes") == 0
    assert (
        total(up, "abplat_spool_flushed_rows_total") - total(before, "abplat_spool_flushed_rows_total") == 5
    )
    assert (
        total(up, "abplat_spool_flushes_total", result="ok")
        - total(before, "abplat_spool_flushes_total", result="ok")
        == 1
    )


def test_store_counts_inserted_rows_seconds_and_errors_by_backend(clickhouse_server, shared_store):
    store = shared_store("server")  # the session's migrated database, empty (tests/sample_dbs.py)
    dead = ClickHouseServerBackend("clickhouse://default:@127.0.0.1:1/abplat_dead", tries=1)
    before = parse(generate_latest(metrics.REGISTRY).decode())
    assert store.insert_samples(sample_rows(4)) == 4
    with pytest.raises(StoreUnavailable):
        dead.insert_samples(sample_rows(2))
    after = parse(generate_latest(metrics.REGISTRY).decode())

    def delta(name, **labels):
        return total(after, name, backend="clickhouse-server", **labels) - total(
            before, name, backend="clickhouse-server", **labels
        )

    assert delta("abplat_store_inserted_rows_total") == 4
    assert delta("abplat_store_insert_duration_seconds_count") == 1
    assert delta("abplat_store_insert_duration_seconds_sum") > 0
    assert delta("abplat_store_insert_errors_total", kind="unavailable") == 1
    assert delta("abplat_store_insert_errors_total", kind="permanent") == 0
