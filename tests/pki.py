"""A private certificate authority for TLS tests: variants behind a CA no public store knows,
and an etcd that asks for client certificates."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("abplat test variant"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclasses.dataclass(frozen=True)
class PKI:
    ca: str  # the bundle that trusts the server
    other_ca: str  # a bundle with an unrelated CA only
    certfile: str
    keyfile: str


def make_pki(d: Path) -> PKI:
    """A test CA, a server certificate it signs (localhost, 127.0.0.1) and an unrelated CA,
    written as PEM files into ``d``."""
    ca_key, ca = _make_ca("abplat test CA")
    key, cert = _make_server_cert(ca_key, ca)
    _, other = _make_ca("some other CA")
    (d / "ca.pem").write_bytes(_pem(ca))
    (d / "other-ca.pem").write_bytes(_pem(other))
    (d / "server.pem").write_bytes(_pem(cert))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (d / "server.key").write_bytes(key_pem)
    return PKI(str(d / "ca.pem"), str(d / "other-ca.pem"), str(d / "server.pem"), str(d / "server.key"))


def _make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    cn: str,
    usages: list[x509.ObjectIdentifier],
    san: list[x509.GeneralName] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    return str(path)


@dataclasses.dataclass(frozen=True)
class EtcdPKI:
    ca: str  # trusts etcd's server certificate, and is the CA etcd trusts for client certificates
    server_cert: str
    server_key: str
    client_cert: str  # a client certificate etcd accepts (CN "abplat-client": no etcd user)
    client_key: str
    stranger_cert: str  # a client certificate from a CA etcd does not trust
    stranger_key: str


def make_etcd_pki(d: Path) -> EtcdPKI:
    """PEM files in ``d`` for an etcd with TLS client-certificate authentication: one CA that
    signs etcd's server certificate (127.0.0.1, localhost) and abplat's client certificate, and
    an unrelated CA that signs a stranger's client certificate."""
    ca_key, ca = _make_ca("abplat test etcd CA")
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, server = _make_leaf(ca_key, ca, "abplat test etcd", [ExtendedKeyUsageOID.SERVER_AUTH], san)
    # The CN is no etcd user name on purpose: with --client-cert-auth etcd takes a client
    # certificate's CN as the user when a request carries no token, and the tests must show
    # that the password (not the certificate) is what grants access.
    client_key, client = _make_leaf(ca_key, ca, "abplat-client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    other_key, other = _make_ca("some other CA")
    stranger_key, stranger = _make_leaf(other_key, other, "abplat-client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    (d / "etcd-ca.pem").write_bytes(_pem(ca))
    (d / "etcd-server.pem").write_bytes(_pem(server))
    (d / "etcd-client.pem").write_bytes(_pem(client))
    (d / "etcd-stranger.pem").write_bytes(_pem(stranger))
    return EtcdPKI(
        ca=str(d / "etcd-ca.pem"),
        server_cert=str(d / "etcd-server.pem"),
        server_key=_write_key(d / "etcd-server.key", server_key),
        client_cert=str(d / "etcd-client.pem"),
        client_key=_write_key(d / "etcd-client.key", client_key),
        stranger_cert=str(d / "etcd-stranger.pem"),
        stranger_key=_write_key(d / "etcd-stranger.key", stranger_key),
    )
