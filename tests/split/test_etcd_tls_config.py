"""The etcd TLS and user settings are checked before anything connects: each mistake is one
line naming the setting (from the factory, and from the settings, abplat/config.py, at process
start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.weights.factory import EtcdSecurity, StoreConfigError, etcd_security, store_from_config
from tests.foundation.test_settings import refusal
from tests.pki import make_etcd_pki

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_etcd_pki(tmp_path_factory.mktemp("etcd-pki"))


def test_good_settings_pass_and_say_whether_tls_is_on(files):
    full = etcd_security(files.ca, files.client_cert, files.client_key, "abplat", "pw")
    assert full.tls and full.user == "abplat"
    assert "pw" not in repr(full)
    assert etcd_security(ca_cert=files.ca).tls  # server-verified TLS without a client certificate
    assert not etcd_security(user="abplat", password="pw").tls
    assert etcd_security(endpoints=[]) == EtcdSecurity()  # nothing set: nothing to check


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"cert": "CERT"},
            "ABPLAT_ETCD_CERT is set but ABPLAT_ETCD_KEY is empty: a client certificate and its key",
        ),
        ({"key": "KEY"}, "ABPLAT_ETCD_KEY is set but ABPLAT_ETCD_CERT is empty"),
        ({"user": "abplat"}, "ABPLAT_ETCD_USER is set but ABPLAT_ETCD_PASSWORD is empty"),
        ({"password": "pw"}, "ABPLAT_ETCD_PASSWORD is set but ABPLAT_ETCD_USER is empty"),
    ],
)
def test_halves_of_a_pair_are_refused_naming_the_missing_one(files, given, message):
    paths = {"CERT": files.client_cert, "KEY": files.client_key}
    with pytest.raises(StoreConfigError, match=message):
        etcd_security(**{field: paths.get(value, value) for field, value in given.items()})


def test_bad_files_are_refused_naming_the_setting_and_the_problem(files, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n")
    cases = [
        (
            {"ca_cert": "/nonexistent/ca.pem"},
            "Unexpected value ABPLAT_ETCD_CA_CERT='/nonexistent/ca.pem': no such file",
        ),
        ({"ca_cert": str(tmp_path)}, "ABPLAT_ETCD_CA_CERT=.*: a directory, not a file"),
        (
            {"ca_cert": str(tmp_path / "notes.txt")},
            "ABPLAT_ETCD_CA_CERT=.*: no PEM '-----BEGIN CERTIFICATE-----'",
        ),
        (
            {"cert": files.client_key, "key": files.client_key},
            "ABPLAT_ETCD_CERT=.*: no PEM '-----BEGIN CERTIFICATE-----'",
        ),
        (
            {"cert": files.client_cert, "key": files.client_cert},
            "ABPLAT_ETCD_KEY=.*: no PEM '-----BEGIN PRIVATE KEY-----'",
        ),
        ({"cert": files.client_cert, "key": str(encrypted)}, "ABPLAT_ETCD_KEY=.*: an encrypted key"),
    ]
    for given, message in cases:
        with pytest.raises(StoreConfigError, match=message):
            etcd_security(**given)


def test_the_settings_without_endpoints_are_refused(files, tmp_path):
    with pytest.raises(StoreConfigError, match="set but ABPLAT_ETCD_ENDPOINTS is empty"):
        store_from_config("", "/abplat/experiments/", str(tmp_path), user="abplat", password="pw")


def test_the_password_never_appears_in_an_error(files):
    with pytest.raises(StoreConfigError) as info:
        etcd_security(password="hunter2-secret")
    assert "hunter2-secret" not in str(info.value)


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_etcd_setting_stops_the_process_at_start_with_one_line(files, tmp_path):
    # Refused by the settings in this process: manage.py prints that one line and stops (tested
    # once, tests/foundation/test_settings.py).
    message = refusal(
        {
            "ABPLAT_VAR": str(tmp_path),
            "ABPLAT_DEBUG": "true",
            "ABPLAT_ETCD_ENDPOINTS": "127.0.0.1:2379",
            "ABPLAT_ETCD_CA_CERT": files.ca,
            "ABPLAT_ETCD_CERT": files.client_cert,
            "ABPLAT_ETCD_KEY": str(tmp_path / "missing.key"),
            "ABPLAT_ETCD_USER": "abplat",
            "ABPLAT_ETCD_PASSWORD": "pw",
        }
    )
    assert message.startswith("Unexpected value ABPLAT_ETCD_KEY=") and "no such file" in message


@pytest.mark.process
def test_good_etcd_settings_pass_the_start_checks(files, tmp_path):
    result = manage(
        "check",
        ABPLAT_VAR=str(tmp_path),
        ABPLAT_DEBUG="true",
        ABPLAT_ETCD_ENDPOINTS="127.0.0.1:2379",
        ABPLAT_ETCD_CA_CERT=files.ca,
        ABPLAT_ETCD_CERT=files.client_cert,
        ABPLAT_ETCD_KEY=files.client_key,
        ABPLAT_ETCD_USER="abplat",
        ABPLAT_ETCD_PASSWORD="pw",
    )
    assert result.returncode == 0, result.stderr
