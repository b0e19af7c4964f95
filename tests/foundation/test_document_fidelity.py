"""The document's fidelity block, the privacy switch of answers' texts: off by default, validated
with field errors, stored, exported and applied back, changed through the admin
(audited, as every change of a document). Through the API: tests/foundation/
test_document_analysis.py, with the analysis block; what a replay then stores:
tests/workers/test_replay_answers.py."""

import pytest
from django.test import Client

from experiments import services
from experiments.document import DocumentError, validate_document
from experiments.models import AuditEntry, Experiment
from tests.foundation.test_admin import change_url, form_data


def errors_of(doc) -> dict[str, list[str]]:
    with pytest.raises(DocumentError) as info:
        validate_document(doc)
    return info.value.as_dict()


DEFAULTS = {"store_answers": False, "score_share": 0.0, "score_top_k": 20, "shadow_share": 0.0}


def test_answers_are_not_stored_unless_the_document_says_so(document):
    assert "fidelity" not in document
    assert validate_document(document)["fidelity"] == DEFAULTS
    document["fidelity"] = {}  # a field left out keeps its default
    assert validate_document(document)["fidelity"] == DEFAULTS
    document["fidelity"] = {"store_answers": True}
    assert validate_document(document)["fidelity"] == {**DEFAULTS, "store_answers": True}
    document["fidelity"] = {"score_share": 1, "score_top_k": 5, "shadow_share": 0.05}
    assert validate_document(document)["fidelity"] == {
        **DEFAULTS,
        "score_share": 1.0,
        "score_top_k": 5,
        "shadow_share": 0.05,
    }


MAPPING = "{store_answers: false, score_share: 0, score_top_k: 20, shadow_share: 0}"
TOP_K = "must be a whole number from 1 to 20 (vLLM's default --max-logprobs), got "


@pytest.mark.parametrize(
    "fidelity, path, message",
    [
        ({"store_answers": "yes"}, "fidelity.store_answers", "must be true or false"),
        ({"store_answers": 1}, "fidelity.store_answers", "must be true or false"),
        ({"store_answers": None}, "fidelity.store_answers", "must be true or false"),
        (
            {"store_texts": True},
            "fidelity.store_texts",
            "unknown field; allowed: score_share, score_top_k, shadow_share, store_answers",
        ),
        (True, "fidelity", "must be a mapping: " + MAPPING),
        (["store_answers"], "fidelity", "must be a mapping: " + MAPPING),
        (
            {"score_share": 1.5},
            "fidelity.score_share",
            "must be a share from 0 to 1 (0.05 = 5% of requests), got 1.5",
        ),
        (
            {"shadow_share": -0.1},
            "fidelity.shadow_share",
            "must be a share from 0 to 1 (0.05 = 5% of requests), got -0.1",
        ),
        (
            {"shadow_share": True},
            "fidelity.shadow_share",
            "must be a share from 0 to 1 (0.05 = 5% of requests), got True",
        ),
        (
            {"shadow_share": float("nan")},
            "fidelity.shadow_share",
            "must be a share from 0 to 1 (0.05 = 5% of requests), got nan",
        ),
        (
            {"score_share": "5%"},
            "fidelity.score_share",
            "must be a share from 0 to 1 (0.05 = 5% of requests), got '5%'",
        ),
        ({"score_top_k": 21}, "fidelity.score_top_k", TOP_K + "21"),
        ({"score_top_k": 0}, "fidelity.score_top_k", TOP_K + "0"),
        ({"score_top_k": 5.0}, "fidelity.score_top_k", TOP_K + "5.0"),
    ],
)
def test_a_bad_block_is_refused_naming_the_field(document, fidelity, path, message):
    document["fidelity"] = fidelity
    assert errors_of(document) == {path: [message]}


def test_an_unknown_top_level_field_names_the_block_among_the_allowed(document):
    document["fidelty"] = {"store_answers": True}
    assert "fidelity" in errors_of(document)["fidelty"][0].split("allowed: ")[1].split(", ")


@pytest.mark.django_db
@pytest.mark.engine
def test_the_switch_is_stored_exported_and_applies_back_unchanged(document):
    exp = services.apply_document(document).experiment
    assert exp.fidelity_store_answers is False  # the default, stored
    document["fidelity"] = {
        "store_answers": True,
        "score_share": 0.25,
        "score_top_k": 8,
        "shadow_share": 0.01,
    }
    exp = services.apply_document(document).experiment
    stored = Experiment.objects.get(pk=exp.pk)
    assert stored.fidelity_store_answers is True
    assert (stored.fidelity_score_share, stored.fidelity_score_top_k, stored.fidelity_shadow_share) == (
        0.25,
        8,
        0.01,
    )
    exported = services.export_document(exp)
    assert exported["fidelity"] == {
        "store_answers": True,
        "score_share": 0.25,
        "score_top_k": 8,
        "shadow_share": 0.01,
    }
    again = services.apply_document(exported)
    assert not again.created and again.changes == []


@pytest.mark.django_db
@pytest.mark.engine
def test_a_running_experiment_may_turn_it_on_and_off_audited(experiment, document, users):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    document["fidelity"] = {"store_answers": True}
    on = services.apply_document(document, actor=users["product"], reason="examples for the review")
    assert on.changes == ["fidelity.store_answers: False -> True"]
    entry = AuditEntry.objects.filter(action="update").get()
    assert entry.before["fidelity"] == DEFAULTS
    assert (
        entry.after["fidelity"] == {**DEFAULTS, "store_answers": True}
        and entry.reason == "examples for the review"
    )
    del document["fidelity"]  # a document without the block turns it off again
    off = services.apply_document(document, actor=users["product"])
    assert off.changes == ["fidelity.store_answers: True -> False"]
    assert AuditEntry.objects.filter(action="update").count() == 2


@pytest.mark.django_db
@pytest.mark.engine
def test_a_concluded_experiment_keeps_it(experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="concluded")
    document["fidelity"] = {"store_answers": True}
    with pytest.raises(DocumentError, match="is concluded and cannot be changed"):
        services.apply_document(document)
    assert Experiment.objects.get(pk=experiment.pk).fidelity_store_answers is False


@pytest.mark.django_db
@pytest.mark.engine
def test_the_admin_form_sets_it(users, experiment, document):
    client = Client()
    client.force_login(users["product"])
    page = client.get(change_url(experiment)).content.decode()
    assert 'name="fidelity_store_answers"' in page
    data = form_data({**document, "fidelity": {"store_answers": True}}, experiment)
    assert data["fidelity_store_answers"] == "on"
    response = client.post(change_url(experiment), data)
    assert response.status_code == 302, response.content.decode()[:3000]
    experiment.refresh_from_db()
    assert experiment.fidelity_store_answers is True
    assert AuditEntry.objects.filter(action="update").get().after["fidelity"] == {
        **DEFAULTS,
        "store_answers": True,
    }
    # unticked: a browser posts nothing for it, and it is off again
    response = client.post(change_url(experiment), form_data(document, experiment))
    assert response.status_code == 302, response.content.decode()[:3000]
    experiment.refresh_from_db()
    assert experiment.fidelity_store_answers is False


def test_a_rollout_guardrail_on_identical_answers_needs_shadows_and_refuses_a_difference(document):
    document["variants"] = document["variants"][:2]
    document["variants"][0]["weight"], document["variants"][1]["weight"] = 100, 0
    document["rollout"] = {
        "candidate": "awq",
        "steps": [5, 50, 100],
        "min_samples": 100,
        "min_duration": "10m",
        "guardrails": [
            {"metric": "attainment", "at_least": "sla_target"},
            {"metric": "identical_answers", "at_least": 0.95},
        ],
    }
    assert errors_of(document) == {
        "rollout.guardrails[1]": [
            "identical_answers reads live requests shadowed to the control: set "
            "fidelity.shadow_share above 0 (e.g. 0.05) so the gateway sends some"
        ]
    }
    document["fidelity"] = {"shadow_share": 0.05}
    doc = validate_document(document)
    assert doc["rollout"]["guardrails"][1] == {"metric": "identical_answers", "at_least": 0.95}
    document["rollout"]["guardrails"][1] = {"metric": "identical_answers", "at_least_over_control": -0.01}
    errors = errors_of(document)
    assert list(errors) == ["rollout.guardrails[1]"]
    assert "at_least_over_control does not apply" in errors["rollout.guardrails[1]"][0]
    assert "use at_least" in errors["rollout.guardrails[1]"][0]


def test_the_shadow_share_error_names_the_guardrail_at_its_place_after_a_refused_one(document):
    document["variants"] = document["variants"][:2]
    document["variants"][0]["weight"], document["variants"][1]["weight"] = 100, 0
    document["rollout"] = {
        "candidate": "awq",
        "steps": [5, 100],
        "min_samples": 100,
        "min_duration": "10m",
        "guardrails": [
            {"metric": "bogus", "at_least": 0.5},
            {"metric": "identical_answers", "at_least": 0.95},
        ],
    }
    errors = errors_of(document)
    assert "guardrail metric must be" in errors["rollout.guardrails[0]"][0]
    assert errors["rollout.guardrails[1]"] == [
        "identical_answers reads live requests shadowed to the control: set "
        "fidelity.shadow_share above 0 (e.g. 0.05) so the gateway sends some"
    ]
