"""Building the configured weights store from plain settings values (no Django import here:
abplat/settings.py reads the environment and passes the strings in)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from experiments.weights.local import LocalWeightsStore
from experiments.weights.store import WeightsStore


class StoreConfigError(ValueError):
    pass


def parse_endpoints(text: str, name: str = "ABPLAT_ETCD_ENDPOINTS") -> list[tuple[str, int]]:
    """'host:port,host:port' -> [(host, port), ...], strictly."""
    endpoints: list[tuple[str, int]] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if not part or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreConfigError(
                f"{name}: item {i + 1} {part!r} is not host:port (e.g. 127.0.0.1:12379); got {text!r}"
            )
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints


def store_from_config(
    etcd_endpoints: str | Sequence[tuple[str, int]], prefix: str, local_dir: str | os.PathLike[str]
) -> WeightsStore:
    """etcd when endpoints are given ("host:port,..." or parsed pairs), else the local file
    store under ``local_dir``."""
    if isinstance(etcd_endpoints, str):
        etcd_endpoints = parse_endpoints(etcd_endpoints) if etcd_endpoints.strip() else []
    if etcd_endpoints:
        from experiments.weights.etcd import EtcdWeightsStore  # grpc only when etcd is used

        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise StoreConfigError(f"ABPLAT_ETCD_PREFIX: must start and end with '/', got {prefix!r}")
        return EtcdWeightsStore(list(etcd_endpoints), prefix=prefix)
    if not str(local_dir):
        raise StoreConfigError("ABPLAT_WEIGHTS_DIR: empty, and no ABPLAT_ETCD_ENDPOINTS given")
    return LocalWeightsStore(local_dir)
