"""Variant endpoints under the egress rules: no credentials in URLs and only hosts
on the variant allowlist, refused alike by the document rules, the API, the admin and the
command line; the settings checked at start; stored credentials stripped by the migration."""

from __future__ import annotations

import importlib
import io

import pytest
import yaml
from django.apps import apps
from django.core.management import CommandError, call_command

from experiments.checks import check_variant_egress
from experiments.document import DocumentError, validate_document
from experiments.models import AuditEntry, Experiment, Variant
from streaming.egress import parse_allowlist
from tests.foundation.test_admin import ADD_URL, admin_client, form_data

DEFAULT = parse_allowlist(["localhost", "127.0.0.0/8", "::1/128"])
CREDENTIALS_URL = "http://admin:hunter2@127.0.0.1:8100/v1"


def errors_of(doc, **rules) -> dict[str, list[str]]:
    with pytest.raises(DocumentError) as info:
        validate_document(doc, **rules)
    return info.value.as_dict()


# --- the document rules (pure) ----------------------------------------------------------------


def test_document_refuses_credentials_in_an_endpoint_naming_the_field(document):
    document["variants"][1]["endpoint"] = CREDENTIALS_URL
    errors = errors_of(document)  # with or without an allowlist
    assert list(errors) == ["variants[1].endpoint"]
    assert "must not carry credentials" in errors["variants[1].endpoint"][0]
    assert "auth: {secret: NAME}" in errors["variants[1].endpoint"][0]
    assert "hunter2" not in str(errors)


@pytest.mark.parametrize(
    "endpoint",
    ["http://10.0.0.5:8000/v1", "http://169.254.169.254/v1", "http://[fd00::1]/v1", "http://db.corp/v1"],
)
def test_document_refuses_a_host_outside_the_allowlist(document, endpoint):
    document["variants"][2]["endpoint"] = endpoint
    errors = errors_of(document, allow=DEFAULT, resolve=lambda host: {"db.corp": ["10.1.2.3"]}[host])
    assert "not in the variant allowlist" in errors["variants[2].endpoint"][0] or (
        "outside the variant allowlist" in errors["variants[2].endpoint"][0]
    )


def test_document_accepts_loopback_and_names_that_resolve_into_the_allowlist(document):
    document["variants"][0]["endpoint"] = "http://localhost:8100/v1"
    document["variants"][1]["endpoint"] = "http://sim.test:8101/v1"
    doc = validate_document(document, allow=DEFAULT, resolve=lambda host: ["127.0.1.1"])
    assert [v["endpoint"] for v in doc["variants"]][:2] == [
        "http://localhost:8100/v1",
        "http://sim.test:8101/v1",
    ]


def test_document_names_a_secret_and_keeps_only_its_name(document):
    document["variants"][0]["auth"] = {"secret": "vllm-key"}
    doc = validate_document(document)
    assert doc["variants"][0]["auth"] == {"secret": "vllm-key"}
    assert doc["variants"][1]["auth"] is None


@pytest.mark.parametrize(
    "auth, path",
    [
        ({"secret": "sk live token"}, "variants[0].auth.secret"),
        ({"secret": "../../etc/passwd"}, "variants[0].auth.secret"),
        ({"token": "sk-live-token"}, "variants[0].auth.token"),
        ("sk-live-token", "variants[0].auth"),
    ],
)
def test_document_refuses_a_bad_auth_without_repeating_it(document, auth, path):
    document["variants"][0]["auth"] = auth
    errors = errors_of(document)
    assert path in errors
    assert "sk-live" not in str(errors) and "sk live" not in str(errors) and "passwd" not in str(errors)


# --- the Django glue: API, admin, command line -------------------------------------------------


@pytest.mark.django_db
def test_api_refuses_credentials_in_an_endpoint_and_writes_nothing(client_for, document):
    document["variants"][0]["endpoint"] = CREDENTIALS_URL
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 400
    assert "must not carry credentials" in response.json()["variants[0].endpoint"][0]
    assert "hunter2" not in response.content.decode()
    assert not Experiment.objects.exists() and not AuditEntry.objects.exists()


@pytest.mark.django_db
def test_api_refuses_an_internal_host_under_the_default_allowlist(client_for, document):
    document["variants"][1]["endpoint"] = "http://10.0.0.5:8000/v1"
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 400
    assert "not in the variant allowlist" in response.json()["variants[1].endpoint"][0]
    assert not Experiment.objects.exists()


@pytest.mark.django_db
def test_api_follows_the_configured_allowlist(client_for, document, settings):
    settings.VARIANT_ALLOWED_HOSTS = ["vllm-a.internal", "127.0.0.0/8"]
    document["variants"][1]["endpoint"] = "http://vllm-a.internal:8000/v1"
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 201, response.json()
    assert Variant.objects.get(key="awq").endpoint == "http://vllm-a.internal:8000/v1"


@pytest.mark.django_db
def test_patch_cannot_slip_an_internal_host_into_an_existing_experiment(client_for, experiment):
    variants = experiment.variants.order_by("position")
    body = {
        "variants": [
            {
                "key": v.key,
                "control": v.control,
                "weight": v.weight,
                "model": v.model,
                "api": v.api,
                "factors": v.factors,
                "endpoint": v.endpoint,
            }
            for v in variants
        ]
    }
    body["variants"][0]["endpoint"] = "http://169.254.169.254/latest"
    response = client_for("product").patch(f"/api/experiments/{experiment.key}/", body, format="json")
    assert response.status_code == 400 and "variants[0].endpoint" in response.json()
    assert experiment.variants.get(key="fp16").endpoint == "http://127.0.0.1:8100/v1"


@pytest.mark.django_db
def test_admin_refuses_credentials_and_internal_hosts_and_writes_nothing(users, document):
    document["variants"][0]["endpoint"] = CREDENTIALS_URL
    document["variants"][1]["endpoint"] = "http://10.0.0.5:8000/v1"
    response = admin_client(users["product"]).post(ADD_URL, form_data(document))
    assert response.status_code == 200
    page = response.content.decode()
    assert "variants[0].endpoint: must not carry credentials" in page
    assert "variants[1].endpoint: host 10.0.0.5 is not in the variant allowlist" in page
    assert not Experiment.objects.exists()


@pytest.mark.django_db
def test_admin_stores_the_secret_name_of_a_variant(users, document, settings, tmp_path):
    # The operator binds the secret to the variants' host (tests/foundation/test_secret_bindings.py).
    (tmp_path / "_bindings.json").write_text('{"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["*"]}}')
    settings.VARIANT_SECRETS_DIR = str(tmp_path)
    data = form_data(document)
    data["variants-0-auth_secret"] = "vllm-key"
    response = admin_client(users["product"]).post(ADD_URL, data)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert Variant.objects.get(key="fp16").auth_secret == "vllm-key"
    assert Variant.objects.get(key="awq").auth_secret == ""


@pytest.mark.django_db
def test_command_line_refuses_an_internal_host(tmp_path, document):
    document["variants"][0]["endpoint"] = "http://10.0.0.5:8000/v1"
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(
        CommandError, match=r"variants\[0\].endpoint: host 10.0.0.5 is not in the variant allowlist"
    ):
        call_command("apply_experiment", str(path), stdout=io.StringIO())
    assert not Experiment.objects.exists()


# --- the settings, checked at start --------------------------------------------------------------


def test_system_check_names_a_bad_allowlist_entry(settings):
    settings.VARIANT_ALLOWED_HOSTS = ["localhost", "10.0.0.1/8"]
    found = check_variant_egress()
    assert [m.id for m in found] == ["abplat.E001"] and "'10.0.0.1/8'" in found[0].msg


def test_system_check_reports_a_missing_secrets_directory(settings, tmp_path):
    settings.VARIANT_SECRETS_DIR = str(tmp_path / "absent")
    assert [m.id for m in check_variant_egress()] == ["abplat.E002"]
    (tmp_path / "file").write_text("x")
    settings.VARIANT_SECRETS_DIR = str(tmp_path / "file")
    assert "not a directory" in check_variant_egress()[0].msg
    settings.VARIANT_SECRETS_DIR = str(tmp_path)
    assert check_variant_egress() == []


def test_the_embedded_default_passes_the_system_check():
    assert check_variant_egress() == []


# --- endpoints stored before the rules --------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.engine
def test_the_migration_strips_credentials_from_stored_endpoints(experiment):
    # A row written before validation refused credentials (bypassing it, as old data did).
    Variant.objects.filter(experiment=experiment, key="awq").update(endpoint=CREDENTIALS_URL)
    migration = importlib.import_module("experiments.migrations.0003_variant_auth_secret")
    migration.strip_credentials(apps, None)
    assert experiment.variants.get(key="awq").endpoint == "http://127.0.0.1:8100/v1"
    assert experiment.variants.get(key="fp16").endpoint == "http://127.0.0.1:8100/v1"
