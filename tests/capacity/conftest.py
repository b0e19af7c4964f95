"""Fixtures for the capacity tests: the real weights stores and a sample store on the real
ClickHouse server, as the rollout tests use them."""

from tests.rollouts.conftest import ch_store  # noqa: F401  (fixture)
from tests.split.conftest import etcd_endpoints, private_etcd, weights_backend  # noqa: F401  (fixtures)
