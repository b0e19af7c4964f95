"""Building the configured weights store from plain settings values (no Django import here:
abplat/config.py reads the environment and passes the strings in)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from experiments.weights.local import LocalWeightsStore
from experiments.weights.store import WeightsStore


class StoreConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How abplat proves itself to etcd; all empty: plain gRPC and no user (development).

    TLS is on when a CA bundle or a client certificate is given (without ``ca_cert`` the
    server's certificate is checked against gRPC's default roots)."""

    ca_cert: str = ""  # PEM bundle of the CAs that sign etcd's server certificate
    cert: str = ""  # PEM client certificate (etcd --client-cert-auth)
    key: str = ""  # its PEM private key
    user: str = ""  # etcd user: the password buys a token, sent with every call
    password: str = dataclasses.field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.ca_cert or self.cert)

    @property
    def given(self) -> bool:
        return bool(self.tls or self.key or self.user or self.password)


# Each file setting: what it must hold and the PEM armour that shows it does.
_PEM_FILES = (
    ("ABPLAT_ETCD_CA_CERT", "ca_cert", "the CAs that sign etcd's server certificate", "CERTIFICATE"),
    ("ABPLAT_ETCD_CERT", "cert", "abplat's etcd client certificate", "CERTIFICATE"),
    ("ABPLAT_ETCD_KEY", "key", "the private key of ABPLAT_ETCD_CERT", "PRIVATE KEY"),
)
_PAIRS = (
    ("ABPLAT_ETCD_CERT", "cert", "ABPLAT_ETCD_KEY", "key", "a client certificate and its key"),
    ("ABPLAT_ETCD_USER", "user", "ABPLAT_ETCD_PASSWORD", "password", "an etcd user and its password"),
)


def etcd_security(
    ca_cert: str = "",
    cert: str = "",
    key: str = "",
    user: str = "",
    password: str = "",
    *,
    endpoints: object = True,
) -> EtcdSecurity:
    """The etcd TLS and authentication settings, checked: pairs given together, each file
    present, readable and PEM. ``endpoints`` is ABPLAT_ETCD_ENDPOINTS (these settings mean
    nothing without it). Raises StoreConfigError with one line naming the setting; never
    echoes the password."""
    security = EtcdSecurity(ca_cert, cert, key, user, password)
    if security.given and not endpoints:
        raise StoreConfigError(
            "ABPLAT_ETCD_CA_CERT/CERT/KEY/USER/PASSWORD are set but ABPLAT_ETCD_ENDPOINTS is "
            "empty: the local weights store (ABPLAT_WEIGHTS_DIR) uses none of them; set the "
            "endpoints or unset them."
        )
    for name_a, field_a, name_b, field_b, what in _PAIRS:
        a, b = getattr(security, field_a), getattr(security, field_b)
        if bool(a) != bool(b):
            present, missing = (name_a, name_b) if a else (name_b, name_a)
            raise StoreConfigError(f"{present} is set but {missing} is empty: {what} go together.")
    for name, field, what, armour in _PEM_FILES:
        path = getattr(security, field)
        if path:
            _check_pem_file(name, path, what, armour)
    return security


def _check_pem_file(name: str, path: str, what: str, armour: str) -> None:
    # Checked here because gRPC reports a missing or garbled file only at the first call, and
    # then as an unexplained handshake failure.
    problem = ""
    try:
        with open(path, "rb") as f:
            text = f.read(1024 * 1024)
    except FileNotFoundError:
        problem = "no such file"
    except IsADirectoryError:
        problem = "a directory, not a file"
    except OSError as exc:
        problem = f"not readable by this process ({exc.strerror or exc})"
    else:
        if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in text:
            problem = "an encrypted key (gRPC reads keys without a passphrase only)"
        elif f"-----BEGIN {armour}-----".encode() not in text and not (
            armour == "PRIVATE KEY" and b" PRIVATE KEY-----" in text  # EC / RSA PRIVATE KEY
        ):
            problem = f"no PEM '-----BEGIN {armour}-----' block in it"
    if problem:
        raise StoreConfigError(f"Unexpected value {name}={path!r}: {problem} (the PEM file of {what}).")


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
    etcd_endpoints: str | Sequence[tuple[str, int]],
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    ca_cert: str = "",
    cert: str = "",
    key: str = "",
    user: str = "",
    password: str = "",
) -> WeightsStore:
    """etcd when endpoints are given ("host:port,..." or parsed pairs), else the local file
    store under ``local_dir``. The keyword arguments are the etcd TLS files and user (see
    ``etcd_security``)."""
    if isinstance(etcd_endpoints, str):
        etcd_endpoints = parse_endpoints(etcd_endpoints) if etcd_endpoints.strip() else []
    security = etcd_security(ca_cert, cert, key, user, password, endpoints=etcd_endpoints)
    if etcd_endpoints:
        from experiments.weights.etcd import EtcdWeightsStore  # grpc only when etcd is used

        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise StoreConfigError(f"ABPLAT_ETCD_PREFIX: must start and end with '/', got {prefix!r}")
        return EtcdWeightsStore(
            list(etcd_endpoints),
            prefix=prefix,
            ca_cert=security.ca_cert,
            cert=security.cert,
            key=security.key,
            user=security.user,
            password=security.password,
        )
    if not str(local_dir):
        raise StoreConfigError("ABPLAT_WEIGHTS_DIR: empty, and no ABPLAT_ETCD_ENDPOINTS given")
    return LocalWeightsStore(local_dir)
