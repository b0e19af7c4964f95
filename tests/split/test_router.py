"""The router: loads, hot-reloads across processes, swaps snapshots atomically, rejects bad
documents, and rides out an etcd restart in the middle of a watch without missing an update."""

from __future__ import annotations

import json
import threading

import pytest

from experiments.assignment import assign
from experiments.weights.document import build_document
from experiments.weights.errors import StoreUnavailable
from experiments.weights.router import Router, UnknownExperiment

BEFORE = {"fp16": 34, "awq": 33, "awq-fa2": 33}
AFTER = {"fp16": 50, "awq": 30, "awq-fa2": 20}


def doc(key="ttft-opt", weights=None, previous=None, reason="start"):
    weights = weights or BEFORE
    return build_document(
        key,
        weights,
        salt=f"salt-{key}",
        control=next(iter(weights)),
        actor="sam",
        reason=reason,
        previous=previous,
    )


@pytest.fixture
def router(store):
    routers: list[Router] = []

    def make(**kw) -> Router:
        r = Router(store, **kw)
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


def test_router_loads_every_experiment_and_tags_assignments_with_the_revision(store, router):
    first = doc()
    r1 = store.put("ttft-opt", first, 0)
    r2 = store.put("other", doc("other", {"a": 100}), 0)
    rt = router()
    assert rt.start(wait=10)
    result = rt.assign("ttft-opt", "user-7")
    assert result.variant == assign(first.salt, "user-7", first.allocation)
    assert (result.experiment, result.revision, result.hash_version) == ("ttft-opt", r1, 1)
    assert rt.assign("other", "user-7").variant == "a"
    assert rt.assign("other", "user-7").revision == r2
    with pytest.raises(UnknownExperiment, match="no weights for experiment 'nope'"):
        rt.assign("nope", "user-7")


WRITER = """
from experiments.weights.document import build_document
current, revision = store.get("ttft-opt")
weights = json.loads(sys.argv[2])
nxt = build_document("ttft-opt", weights, salt=current.salt, control=current.control,
                     actor="other-process", reason="hot reload", previous=current)
print(store.put("ttft-opt", nxt, revision))
"""


@pytest.mark.process
def test_weights_written_by_another_process_reach_a_running_router(
    store, store_config, router, spawn, wait_until
):
    store.put("ttft-opt", doc(), 0)
    rt = router()
    assert rt.start(wait=10)
    child = spawn(WRITER, store_config, json.dumps(AFTER))
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    new_revision = int(out)
    wait_until(lambda: rt.assign("ttft-opt", "u").revision == new_revision, "the new revision")
    document, revision = rt.document("ttft-opt")
    assert dict(document.weights) == AFTER and document.actor == "other-process"
    assert revision == new_revision


def test_malformed_document_written_by_hand_is_rejected_and_the_previous_kept(store, router, wait_until):
    good = doc()
    r1 = store.put("ttft-opt", good, 0)
    rt = router()
    assert rt.start(wait=10)
    expected = rt.assign("ttft-opt", "user-1")

    r2 = store.put_raw("ttft-opt", b'{"schema_version": 1, "weights": {"fp16": 150}', r1)
    wait_until(lambda: rt.metrics["documents_rejected"] == 1, "the rejection")
    assert rt.assign("ttft-opt", "user-1") == expected  # still revision r1's answer
    rejection = rt.rejections["ttft-opt"]
    assert rejection.revision == r2 and "not valid JSON" in rejection.reason

    # Valid JSON but invalid weights: also rejected, counted once more.
    bad = good.to_json() | {"weights": {"fp16": 90, "awq": 30, "awq-fa2": -20}}
    r3 = store.put_raw("ttft-opt", json.dumps(bad).encode(), r2)
    wait_until(lambda: rt.metrics["documents_rejected"] == 2, "the second rejection")
    assert "weights.awq-fa2: must be >= 0, got -20" in rt.rejections["ttft-opt"].reason
    assert rt.assign("ttft-opt", "user-1").revision == r1

    # A valid document afterwards is applied and clears the rejection.
    r4 = store.put("ttft-opt", doc(weights=AFTER, previous=good), r3)
    wait_until(lambda: rt.assign("ttft-opt", "user-1").revision == r4, "the good document")
    assert "ttft-opt" not in rt.rejections
    assert rt.metrics["documents_rejected"] == 2


def test_document_under_the_wrong_key_is_rejected_at_load(store, router):
    store.put_raw("copied", doc("ttft-opt").dumps(), 0)
    rt = router()
    assert rt.start(wait=10)
    assert rt.metrics["documents_rejected"] == 1
    with pytest.raises(UnknownExperiment, match="does not match the key it is stored under"):
        rt.assign("copied", "u")


def test_deleted_experiment_disappears_from_the_router(store, router, wait_until):
    store.put("ttft-opt", doc(), 0)
    rt = router()
    assert rt.start(wait=10)
    store.delete("ttft-opt")
    wait_until(lambda: "ttft-opt" not in rt.snapshot, "the delete")


def test_readers_never_see_half_an_update(store, router):
    """Readers hammer assign() while weights flip; every answer must equal the answer of the
    complete document at the revision the reader was told."""
    current = doc()
    revision = store.put("ttft-opt", current, 0)
    docs = {revision: current}
    rt = router()
    assert rt.start(wait=10)
    stop = threading.Event()
    seen: list[tuple[str, int, str]] = []

    def read(worker: int) -> None:
        i = 0
        while not stop.is_set():
            user = f"u{worker}-{i % 500}"
            result = rt.assign("ttft-opt", user)
            seen.append((user, result.revision, result.variant))
            i += 1

    readers = [threading.Thread(target=read, args=(w,)) for w in range(2)]
    for t in readers:
        t.start()
    for step in range(16):
        nxt = doc(weights=AFTER if step % 2 == 0 else BEFORE, previous=current)
        revision = store.put("ttft-opt", nxt, revision)
        docs[revision] = current = nxt
        rt.refresh()  # apply synchronously as well, so the readers see every revision
    stop.set()
    for t in readers:
        t.join()
    revisions_seen = {r for _, r, _ in seen}
    assert len(revisions_seen) > 5
    for user, rev, variant in seen:
        d = docs[rev]
        assert variant == assign(d.salt, user, d.allocation), (user, rev)


def test_router_started_while_the_store_is_down_reports_why(wait_until):
    from experiments.weights.etcd import EtcdWeightsStore

    dead = EtcdWeightsStore([("127.0.0.1", 1)], prefix="/abplat-test/dead/", timeout=0.5)
    rt = Router(dead, backoff_max=0.2)
    try:
        assert rt.start(wait=0.5) is False
        with pytest.raises(UnknownExperiment, match="has not loaded the weights store yet"):
            rt.assign("ttft-opt", "u")
        wait_until(lambda: rt.metrics["store_errors"] >= 1, "the failed load to be counted")
        with pytest.raises(StoreUnavailable, match=r"etcd 127\.0\.0\.1:1 prefix"):
            rt.refresh()
    finally:
        rt.stop()
        dead.close()


# A private etcd (conftest.private_etcd), so restarting it disturbs nothing else -----------


def test_router_survives_an_etcd_restart_mid_watch_and_misses_no_update(private_etcd, wait_until):
    store = private_etcd.store
    first = doc()
    revision = store.put("ttft-opt", first, 0)
    rt = Router(store, backoff_min=0.05, backoff_max=0.5)
    try:
        assert rt.start(wait=10)
        wait_until(lambda: rt.metrics["watch_registrations"] == 1, "the watch")
        expected = rt.assign("ttft-opt", "user-1")

        # 1. etcd goes down under an open watch: the router keeps its last good snapshot.
        private_etcd.stop()
        wait_until(lambda: not rt.connected, "the router to notice the outage")
        assert rt.assign("ttft-opt", "user-1") == expected
        with pytest.raises(StoreUnavailable):
            store.put("ttft-opt", doc(weights=AFTER, previous=first), revision)

        # 2. etcd comes back; changes are written at once, racing the watch re-registration.
        private_etcd.start()
        writer = private_etcd.new_client()
        written = {}
        current = first
        for i in range(10):
            weights = AFTER if i % 2 == 0 else BEFORE
            current = doc(weights=weights, previous=current, reason=f"change {i}")
            revision = writer.put("ttft-opt", current, revision)
            key = f"exp-{i}"
            written[key] = writer.put(key, doc(key), 0)
        written["ttft-opt"] = revision

        # 3. Every change arrives: each new experiment, and the last weights of ttft-opt.
        wait_until(
            lambda: all(
                k in rt.snapshot and rt.snapshot.entries[k].revision == r for k, r in written.items()
            ),
            "all 11 changes in the router",
        )
        assert rt.metrics["watch_registrations"] >= 2  # the watch was re-registered
        assert rt.metrics["watch_errors"] >= 1
        assert rt.document("ttft-opt")[0].reason == "change 9"
        assert rt.connected

        # 4. The same through scripts/etcd.sh restart: a change right after it still arrives.
        private_etcd.restart()
        current = doc(weights=AFTER, previous=current, reason="after restart")
        final = private_etcd.new_client().put("ttft-opt", current, revision)
        wait_until(lambda: rt.assign("ttft-opt", "u").revision == final, "the change after restart")
    finally:
        rt.stop()
