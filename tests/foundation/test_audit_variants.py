"""What a variant measures: engine flags a product user may set, checked when the
experiment is defined; endpoint, model, api, http2 and engine_args fixed while it runs, audited
with before and after while it is a draft or paused."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from experiments import services
from experiments.document import DocumentError
from experiments.models import AuditEntry, Experiment, Variant

pytestmark = pytest.mark.django_db


def variants(experiment) -> dict[str, dict]:
    return {v["key"]: v for v in services.export_document(experiment)["variants"]}


def admin_form(document, experiment) -> dict:
    """The experiment change form as the admin posts it (existing variants only)."""
    rows = {v.key: v.pk for v in experiment.variants.all()}
    data = {
        "key": document["key"],
        "name": document["name"],
        "hypothesis": document["hypothesis"],
        "sla_ttft_ms": document["sla"]["ttft_ms"],
        "sla_target": document["sla"]["target"],
        "sla_tpot_ms": "",
        "sla_e2e_ms": "",
        "variants-TOTAL_FORMS": len(document["variants"]),
        "variants-INITIAL_FORMS": len(rows),
        "variants-MIN_NUM_FORMS": 2,
        "variants-MAX_NUM_FORMS": 1000,
    }
    for i, v in enumerate(document["variants"]):
        p = f"variants-{i}-"
        data.update(
            {
                p + "key": v["key"],
                p + "weight": v["weight"],
                p + "endpoint": v["endpoint"],
                p + "model": v["model"],
                p + "api": v.get("api", "chat"),
                p + "factors": json.dumps(v.get("factors", {})),
                p + "engine_args": json.dumps(v.get("engine_args", {})),
                p + "id": rows[v["key"]],
                p + "experiment": experiment.pk,
            }
        )
        if v.get("control"):
            data[p + "control"] = "on"
    return data


# Engine flags, when the experiment is defined ---------------------------------------------------


def test_an_engine_flag_a_product_user_may_not_set_is_refused_when_defining(document, users):
    document["variants"][1]["engine_args"] = {"quantization": "awq", "worker-extension-cls": "evil.Ext"}
    with pytest.raises(DocumentError) as info:
        services.apply_document(document, actor=users["product"])
    [message] = info.value.as_dict()["variants[1].engine_args.worker_extension_cls"]
    assert message.startswith("variant 'awq': --worker-extension-cls is not an engine flag")
    assert "Allowed: " in message and "max-num-seqs" in message
    assert not Experiment.objects.exists() and not AuditEntry.objects.exists()


def test_the_api_answers_400_naming_the_variant_and_the_flag(client_for, document):
    document["variants"][2]["engine_args"] = {"api_key": "k"}
    response = client_for("product").post("/api/experiments/", document, format="json")
    assert response.status_code == 400, response.content
    [message] = response.json()["variants[2].engine_args.api_key"]
    assert "variant 'awq-fa2'" in message and "--api-key" in message
    assert not Experiment.objects.exists()


def test_a_risky_flag_may_be_defined_serving_it_is_the_operators_call(document, users):
    document["variants"][1]["engine_args"] = {"quantization": "awq", "trust_remote_code": True}
    experiment = services.apply_document(document, actor=users["product"]).experiment
    assert variants(experiment)["awq"]["engine_args"]["trust_remote_code"] is True


@pytest.mark.engine
def test_engine_args_stored_before_the_allowlist_do_not_block_other_changes(experiment, document):
    Variant.objects.filter(experiment=experiment, key="awq").update(engine_args={"api_key": "old"})
    document["variants"][1]["engine_args"] = {"api_key": "old"}
    document["name"] = "renamed"
    assert services.apply_document(document).changes == ["name: 'TTFT optimizations' -> 'renamed'"]
    document["variants"][1]["engine_args"] = {"api_key": "new"}
    with pytest.raises(DocumentError, match="--api-key is not an engine flag"):
        services.apply_document(document)


# A running experiment keeps what its variants measure ------------------------------------------

CHANGES = {
    "endpoint": "http://127.0.0.1:9101/v1",
    "model": "other-model",
    "api": "completions",
    "http2": True,
    "engine_args": {"quantization": "awq", "max_num_seqs": 8},
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_running_experiment_refuses_a_change_of_what_a_variant_measures(experiment, document, field):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    before = variants(experiment)
    audited = AuditEntry.objects.count()
    document["variants"][1][field] = CHANGES[field]
    with pytest.raises(DocumentError) as info:
        services.apply_document(document)
    [message] = info.value.as_dict()[f"variants[1].{field}"]
    assert f"cannot change variant 'awq''s {field} while experiment 'ttft-opt' is running" in message
    assert "pause it first" in message
    assert variants(experiment) == before and AuditEntry.objects.count() == audited


def test_the_api_refuses_it_too(client_for, experiment):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    doc = services.export_document(experiment)
    doc["variants"][0]["endpoint"] = "http://127.0.0.1:9100/v1"
    response = client_for("product").patch(
        f"/api/experiments/{experiment.key}/", {"variants": doc["variants"]}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "pause it first" in response.json()["variants[0].endpoint"][0]
    assert variants(experiment)["fp16"]["endpoint"] == "http://127.0.0.1:8100/v1"


def test_the_admin_refuses_it_too(users, experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    document["variants"][1]["endpoint"] = "http://127.0.0.1:9101/v1"
    client = Client()
    client.force_login(users["product"])
    response = client.post(
        f"/admin/experiments/experiment/{experiment.pk}/change/", admin_form(document, experiment)
    )
    assert response.status_code == 200
    assert "while experiment &#x27;ttft-opt&#x27; is running" in response.content.decode()
    assert variants(experiment)["awq"]["endpoint"] == "http://127.0.0.1:8101/v1"


def test_the_admin_refuses_an_engine_flag_a_product_user_may_not_set(users, experiment, document):
    document["variants"][1]["engine_args"] = {"middleware": "evil.app"}
    client = Client()
    client.force_login(users["product"])
    response = client.post(
        f"/admin/experiments/experiment/{experiment.pk}/change/", admin_form(document, experiment)
    )
    assert response.status_code == 200
    assert "--middleware is not an engine flag a variant may set" in response.content.decode()
    assert variants(experiment)["awq"]["engine_args"] == {"quantization": "awq"}


@pytest.mark.engine
def test_a_paused_experiment_may_change_them_audited_before_and_after(experiment, document, users):
    Experiment.objects.filter(pk=experiment.pk).update(status="paused")
    document["variants"][1]["endpoint"] = "http://127.0.0.1:9101/v1"
    document["variants"][1]["engine_args"] = {"quantization": "awq", "max_num_seqs": 8}
    result = services.apply_document(document, actor=users["product"])
    assert (
        "variants[awq].endpoint: 'http://127.0.0.1:8101/v1' -> 'http://127.0.0.1:9101/v1'" in result.changes
    )
    entry = AuditEntry.objects.filter(action="update").get()
    assert entry.actor_name == "pat"
    was = {v["key"]: v for v in entry.before["variants"]}["awq"]
    now = {v["key"]: v for v in entry.after["variants"]}["awq"]
    assert (was["endpoint"], now["endpoint"]) == ("http://127.0.0.1:8101/v1", "http://127.0.0.1:9101/v1")
    assert (was["engine_args"], now["engine_args"]) == (
        {"quantization": "awq"},
        {"quantization": "awq", "max_num_seqs": 8},
    )


@pytest.mark.engine
def test_a_running_experiment_still_takes_a_new_name_and_sla(experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    document["name"] = "TTFT optimizations, week 2"
    document["sla"]["target"] = 0.99
    assert len(services.apply_document(document).changes) == 2
