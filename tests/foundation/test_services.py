"""Applying, exporting and auditing experiment documents."""

import pytest

from experiments import services
from experiments.document import DocumentError
from experiments.models import AuditEntry, Experiment, Variant

pytestmark = pytest.mark.engine


@pytest.mark.django_db
def test_apply_creates_then_is_idempotent(document, users):
    first = services.apply_document(document, actor=users["product"])
    assert first.created and first.experiment.variants.count() == 3
    again = services.apply_document(document, actor=users["product"])
    assert not again.created and again.changes == []
    assert AuditEntry.objects.filter(experiment_key="ttft-opt").count() == 1


@pytest.mark.django_db
def test_apply_of_export_is_a_no_op(experiment):
    exported = services.export_document(experiment)
    assert services.apply_document(exported).changes == []
    assert services.export_document(Experiment.objects.get(pk=experiment.pk)) == exported


@pytest.mark.django_db
def test_update_reports_changes_and_audits_before_after(experiment, document, users):
    document["name"] = "Renamed"
    document["variants"][0]["weight"], document["variants"][1]["weight"] = 50, 17
    result = services.apply_document(document, actor=users["product"])
    assert "name: 'TTFT optimizations' -> 'Renamed'" in result.changes
    assert "variants[fp16].weight: 34 -> 50" in result.changes
    entry = AuditEntry.objects.filter(action="update").get()
    assert entry.actor_name == "pat" and entry.before["name"] == "TTFT optimizations"
    assert entry.after["variants"][0]["weight"] == 50


@pytest.mark.django_db
def test_control_can_move_to_another_variant_in_draft(experiment, document):
    document["variants"][0]["control"] = False
    document["variants"][2]["control"] = True
    services.apply_document(document)
    assert Variant.objects.get(experiment=experiment, control=True).key == "awq-fa2"


@pytest.mark.django_db
def test_rejected_document_changes_nothing(experiment, document):
    before = services.export_document(experiment)
    audit_count = AuditEntry.objects.count()
    document["name"] = "Should not stick"
    document["variants"][1]["endpoint"] = "not a url"
    with pytest.raises(DocumentError):
        services.apply_document(document)
    assert services.export_document(Experiment.objects.get(pk=experiment.pk)) == before
    assert AuditEntry.objects.count() == audit_count


@pytest.mark.django_db
def test_removing_and_adding_variants_in_draft(experiment, document):
    document["variants"] = document["variants"][:2]
    document["variants"][1]["weight"] = 66
    result = services.apply_document(document)
    assert "variants[awq-fa2]: removed" in result.changes
    assert list(experiment.variants.values_list("key", flat=True)) == ["fp16", "awq"]


@pytest.mark.django_db
def test_locked_experiment_rejects_structure_and_weight_changes(experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="running")
    document["variants"][0]["weight"], document["variants"][1]["weight"] = 50, 17
    document["variants"][2]["factors"]["attention"] = "sdpa"
    with pytest.raises(DocumentError) as info:
        services.apply_document(document)
    errors = info.value.as_dict()
    assert "set_weights" in errors["variants[0].weight"][0]
    assert "variants[2].factors" in errors


@pytest.mark.django_db
def test_locked_experiment_accepts_name_and_sla_changes(experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="paused")
    document["sla"]["target"] = 0.99
    assert services.apply_document(document).changes == ["sla.target: 0.992 -> 0.99"]


@pytest.mark.django_db
def test_concluded_experiment_cannot_change(experiment, document):
    Experiment.objects.filter(pk=experiment.pk).update(status="concluded")
    document["name"] = "late edit"
    with pytest.raises(DocumentError, match="concluded"):
        services.apply_document(document)


@pytest.mark.django_db
def test_delete_only_in_draft(experiment):
    from experiments.lifecycle import TransitionError

    Experiment.objects.filter(pk=experiment.pk).update(status="paused")
    experiment.refresh_from_db()
    with pytest.raises(TransitionError, match="only draft"):
        services.delete_experiment(experiment)
    Experiment.objects.filter(pk=experiment.pk).update(status="draft")
    experiment.refresh_from_db()
    services.delete_experiment(experiment)
    assert not Experiment.objects.exists()
    assert AuditEntry.objects.filter(experiment_key="ttft-opt", action="delete").exists()


@pytest.mark.django_db
def test_audit_log_is_append_only(experiment):
    entry = AuditEntry.objects.first()
    entry.reason = "rewrite history"
    with pytest.raises(ValueError, match="append-only"):
        entry.save()
    with pytest.raises(ValueError, match="append-only"):
        entry.delete()


@pytest.mark.django_db
def test_salt_fixed_at_creation_and_distinct(document):
    a = services.apply_document(document).experiment
    document["key"] = "other"
    b = services.apply_document(document).experiment
    assert len(a.salt) == 32 and a.salt != b.salt
    document["key"] = "ttft-opt"
    document["name"] = "x"
    services.apply_document(document)
    a2 = Experiment.objects.get(pk=a.pk)
    assert a2.salt == a.salt


def test_every_lifecycle_move_is_announced_inside_its_transaction(experiment, users):
    from experiments.signals import experiment_transitioned

    heard = []

    def listener(sender, experiment, action, before, after, actor, **kwargs):
        heard.append((action, str(before), str(after), str(experiment.status), actor))

    experiment_transitioned.connect(listener)
    try:
        services.transition(experiment, "start", users["product"])
        services.transition(experiment, "pause", users["product"])
    finally:
        experiment_transitioned.disconnect(listener)
    assert heard == [
        ("start", "draft", "running", "running", users["product"]),
        ("pause", "running", "paused", "paused", users["product"]),
    ]


def test_a_listener_that_fails_rolls_the_move_back(experiment, users):
    from experiments.signals import experiment_transitioned

    def refuse(**kwargs):
        raise RuntimeError("replays could not be cancelled")

    services.transition(experiment, "start", users["product"])
    experiment_transitioned.connect(refuse)
    try:
        with pytest.raises(RuntimeError, match="could not be cancelled"):
            services.transition(experiment, "conclude", users["product"])
    finally:
        experiment_transitioned.disconnect(refuse)
    experiment.refresh_from_db()
    assert experiment.status == "running"
    assert not AuditEntry.objects.filter(experiment=experiment, action="conclude").exists()
