"""The weights store interface, run against the local file store and a real etcd alike."""

from __future__ import annotations

import json
import threading

import pytest

from experiments.weights.document import build_document
from experiments.weights.errors import ConflictError, WeightsError
from experiments.weights.factory import StoreConfigError, parse_endpoints, store_from_config
from experiments.weights.local import LocalWeightsStore


def doc(key="ttft-opt", weights=None, previous=None, reason="start"):
    return build_document(
        key,
        weights or {"fp16": 50, "awq": 50},
        salt="salt-1",
        control="fp16",
        actor="sam",
        reason=reason,
        previous=previous,
    )


def test_create_then_get_returns_the_document_and_its_revision(store):
    assert store.get("ttft-opt") is None
    first = doc()
    revision = store.put("ttft-opt", first, expected_revision=0)
    assert revision > 0
    assert store.get("ttft-opt") == (first, revision)


def test_create_of_an_existing_key_is_a_conflict(store):
    revision = store.put("ttft-opt", doc(), 0)
    with pytest.raises(ConflictError) as info:
        store.put("ttft-opt", doc(reason="second create"), 0)
    assert (info.value.expected_revision, info.value.actual_revision) == (0, revision)
    assert store.get("ttft-opt")[0].reason == "start"


def test_stale_revision_is_a_conflict_and_writes_nothing(store):
    first = doc()
    r1 = store.put("ttft-opt", first, 0)
    r2 = store.put("ttft-opt", doc(weights={"fp16": 90, "awq": 10}, previous=first), r1)
    assert r2 > r1
    with pytest.raises(ConflictError, match=f"expected revision {r1}, but it is now at revision {r2}"):
        store.put("ttft-opt", doc(weights={"fp16": 10, "awq": 90}, previous=first), r1)
    assert store.get("ttft-opt")[0].weights == {"fp16": 90, "awq": 10}


def test_update_of_a_missing_key_is_a_conflict(store):
    with pytest.raises(ConflictError, match="does not exist"):
        store.put("ttft-opt", doc(), 3)


def test_revisions_increase_across_keys_and_listing_is_consistent(store):
    revisions = [store.put(f"exp-{i}", doc(f"exp-{i}"), 0) for i in range(3)]
    assert revisions == sorted(revisions) and len(set(revisions)) == 3
    listing = store.list_raw()
    assert {k: v.revision for k, v in listing.values.items()} == {
        f"exp-{i}": r for i, r in enumerate(revisions)
    }
    assert listing.revision >= revisions[-1]
    assert set(store.list_all()) == {"exp-0", "exp-1", "exp-2"}


def test_list_all_leaves_out_invalid_documents(store):
    store.put("good", doc("good"), 0)
    store.put_raw("bad", b"{broken", 0)
    assert set(store.list_all()) == {"good"}
    with pytest.raises(WeightsError, match="not valid JSON"):
        store.get("bad")


def test_put_refuses_a_document_for_another_key_and_bad_keys(store):
    with pytest.raises(WeightsError, match="document is for 'ttft-opt', not 'other'"):
        store.put("other", doc(), 0)
    with pytest.raises(WeightsError, match="experiment: must be a slug"):
        store.get("../etc/passwd")


def test_delete_removes_the_key(store):
    store.put("ttft-opt", doc(), 0)
    store.delete("ttft-opt")
    assert store.get("ttft-opt") is None
    assert store.put("ttft-opt", doc(), 0) > 0  # and it can be created again


def test_watch_from_a_past_revision_replays_changes_then_follows_new_ones(store):
    first = doc()
    r1 = store.put("ttft-opt", first, 0)
    r2 = store.put("ttft-opt", doc(weights={"fp16": 20, "awq": 80}, previous=first), r1)
    r3 = store.put("other", doc("other"), 0)
    stop = threading.Event()
    registered = threading.Event()  # the watch's first batch is out: it follows from here on
    seen: list = []

    def follow():
        for batch in store.watch(r2, stop):
            seen.extend(batch)
            registered.set()
            if any(e.raw is None for e in batch):
                stop.set()

    thread = threading.Thread(target=follow)
    thread.start()
    assert registered.wait(20)
    store.delete("other")
    thread.join(timeout=20)
    stop.set()
    assert not thread.is_alive()
    # r1 is before the start revision; r2, r3 are replayed (etcd) or current state (local),
    # then the delete arrives as an event with raw None.
    assert [(e.key, e.revision) for e in seen if e.raw is not None][-2:] == [
        ("ttft-opt", r2),
        ("other", r3),
    ]
    assert all(e.revision >= r2 for e in seen)
    assert seen[-1].key == "other" and seen[-1].raw is None and seen[-1].revision > r3


CAS_CHILD = """
from experiments.weights.document import build_document
from experiments.weights.errors import ConflictError
conflicts = 0
for _ in range(int(sys.argv[2])):
    while True:
        current, revision = store.get("counter")
        n = int(current.reason) + 1
        nxt = build_document("counter", dict(current.weights), salt=current.salt,
                             control=current.control, actor=sys.argv[3], reason=str(n),
                             previous=current)
        try:
            store.put("counter", nxt, revision)
            break
        except ConflictError:
            conflicts += 1
print(json.dumps({"conflicts": conflicts}))
"""


@pytest.mark.process
def test_two_processes_incrementing_with_compare_and_set_lose_no_update(store, store_config, spawn):
    store.put("counter", doc("counter", reason="0"), 0)
    per_process = 40
    children = [spawn(CAS_CHILD, store_config, str(per_process), f"p{i}") for i in range(2)]
    results = [child.communicate(timeout=120) for child in children]
    for child, (_out, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err
    final, _ = store.get("counter")
    assert int(final.reason) == 2 * per_process
    conflicts = sum(json.loads(out)["conflicts"] for out, _ in results)
    print(f"conflicts resolved by retry: {conflicts}")


def test_local_store_writes_whole_files_and_keeps_no_temp_files(local_store):
    local_store.put("ttft-opt", doc(), 0)
    names = sorted(p.name for p in local_store.directory.iterdir())
    assert names == [".lock", ".revision", "ttft-opt.json"]
    envelope = json.loads((local_store.directory / "ttft-opt.json").read_text())
    assert envelope["revision"] == 1 and json.loads(envelope["value"])["experiment"] == "ttft-opt"


def test_local_store_file_edited_into_garbage_is_handed_on_for_rejection(local_store):
    local_store.put("ttft-opt", doc(), 0)
    (local_store.directory / "ttft-opt.json").write_text("not an envelope")
    with pytest.raises(WeightsError, match="not valid JSON"):
        local_store.get("ttft-opt")


def test_factory_picks_etcd_when_endpoints_are_given_else_local(tmp_path, etcd_endpoints):
    local = store_from_config("", "/abplat/experiments/", str(tmp_path / "w"))
    assert isinstance(local, LocalWeightsStore)
    remote = store_from_config("127.0.0.1:12379", "/abplat/x/", str(tmp_path))
    assert type(remote).__name__ == "EtcdWeightsStore" and remote.prefix == "/abplat/x/"
    remote.close()
    assert parse_endpoints("a:1, b:2") == [("a", 1), ("b", 2)]


@pytest.mark.parametrize(
    ("endpoints", "prefix", "message"),
    [
        ("127.0.0.1", "/p/", "item 1 '127.0.0.1' is not host:port"),
        ("h:1,h:99999", "/p/", "item 2 'h:99999' is not host:port"),
        ("h:1,", "/p/", "item 2 '' is not host:port"),
        ("h:1", "no-slash", "ABPLAT_ETCD_PREFIX: must start and end with '/'"),
    ],
)
def test_factory_rejects_bad_configuration_naming_the_setting(endpoints, prefix, message):
    with pytest.raises(StoreConfigError, match=message):
        store_from_config(endpoints, prefix, "/tmp/x")
