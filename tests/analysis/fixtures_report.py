"""Fixtures for the report tests: synthetic samples in chDB and in the ClickHouse server.

Imported by the test modules (`from tests.analysis.fixtures_report import *`-style names), not a
conftest; the server and chDB directory come from the root conftest. Every dataset is
generated once per session and loaded into a fresh database on each backend.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import pytest

from analysis import definitions as q
from analysis import report as r
from samples import synthetic
from samples.backends.chdb import ChdbBackend
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.store import SampleStore
from tests.plugin import server_url_for

SLO = q.Slo(200.0)
TARGET = 0.9


def split_spec() -> synthetic.SyntheticSpec:
    return synthetic.SyntheticSpec(
        n=30_000,
        seed=6,
        run_id=11,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        config_revisions=(101, 102),
        duplicate_rate=0.01,
        duration_s=1800.0,
    )


def mirror_spec() -> synthetic.SyntheticSpec:
    return synthetic.SyntheticSpec(
        experiment="ttft-mirror",
        mode="mirror",
        n=4_000,
        seed=7,
        run_id=12,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=600.0,
    )


def info(spec: synthetic.SyntheticSpec, **over) -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=spec.experiment,
        name=spec.experiment,
        slo=over.pop("slo", SLO),
        target=TARGET,
        variants=[r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in spec.variants],
        **over,
    )


@pytest.fixture(scope="session")
def split_data() -> synthetic.Synthetic:
    return synthetic.generate(split_spec())


@pytest.fixture(scope="session")
def mirror_data() -> synthetic.Synthetic:
    return synthetic.generate(mirror_spec())


def load_stores(chdb_dir: str, prefix: str, datasets) -> dict[str, SampleStore]:
    """{"chdb": store, "server": store}: fresh databases holding the datasets, deduplicated."""
    db = f"{prefix}_{uuid.uuid4().hex[:8]}"
    stores: dict[str, SampleStore] = {
        # chDB allows one data directory per process: the session's (root conftest chdb_dir)
        "chdb": ChdbBackend(chdb_dir, db),
        "server": ClickHouseServerBackend(server_url_for(db), send_receive_timeout=120),
    }
    for store in stores.values():
        store.migrate()
        for data in datasets:
            synthetic.insert(store, data)
        # the dedup contract: reads skip FINAL, so the older recordings go the way a finished
        # replay's do (SampleStore.deduplicate, OPTIMIZE ... FINAL)
        # (background merges may already have removed some: deduplicate returns what was left)
        assert 0 <= store.deduplicate() <= sum(int(d.is_duplicate.sum()) for d in datasets)
    return stores


def drop_stores(stores: dict[str, SampleStore]) -> None:
    for store in stores.values():
        try:
            store.execute(f"DROP DATABASE IF EXISTS {store.database}")
        except Exception:
            pass
        store.close()


@pytest.fixture(scope="session")
def loaded_stores(
    chdb_dir: str, clickhouse_server: str, split_data, mirror_data
) -> Iterator[dict[str, SampleStore]]:
    """{"chdb": store, "server": store}, both holding the split and the mirror dataset."""
    stores = load_stores(chdb_dir, "abplat_test_dash", (split_data, mirror_data))
    yield stores
    drop_stores(stores)


@pytest.fixture(params=["chdb", "server"])
def backend(request: pytest.FixtureRequest, loaded_stores) -> SampleStore:
    return loaded_stores[request.param]


def assert_same(a, b, path: str = "") -> None:
    """Equal, floats to 1e-9 relative (sums of the same values in another order), except the
    p99-over-time chart, whose rollup values are within the 1 ms bucket of the exact ones (and
    whose note says so)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if k not in ("timing", "generated_at") and f"{path}.{k}" != ".timeseries.note":
                assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        tol = 1.0 if ".p99_ttft_ms." in path and path.endswith(".p99") else 1e-9 * max(1.0, abs(a))
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol, f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
