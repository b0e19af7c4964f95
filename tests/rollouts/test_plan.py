"""The document's rollout: block: validated with field-path errors, stored, exported and applied
back unchanged."""

from __future__ import annotations

import pytest

from experiments.document import DocumentError, parse_duration, validate_document
from streaming.egress import parse_allowlist


def errors_of(doc, **kw) -> dict[str, list[str]]:
    with pytest.raises(DocumentError) as exc:
        validate_document(doc, **kw)
    return exc.value.as_dict()


def test_a_valid_plan_is_normalized_and_keeps_sla_target_symbolic(rollout_document):
    doc = validate_document(rollout_document)
    plan = doc["rollout"]
    assert plan["candidate"] == "awq-fa2" and plan["steps"] == [10, 50, 100]
    assert plan["guardrails"][0] == {"metric": "attainment", "at_least": "sla_target"}
    assert plan["on_breach"] == "rollback" and plan["notify"] == [] and plan["alpha"] == 0.05


def test_a_document_without_a_plan_has_no_rollout_key(rollout_document):
    del rollout_document["rollout"]
    assert "rollout" not in validate_document(rollout_document)


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"candidate": "fp16"}, "rollout.candidate", "must not be the control"),
        ({"candidate": "nope"}, "rollout.candidate", "must be one of the variants"),
        ({"candidate": None}, "rollout.candidate", "is required"),
        ({"steps": [10, 5, 100]}, "rollout.steps[1]", "larger than the step before (10)"),
        ({"steps": [10, 10, 100]}, "rollout.steps[1]", "larger than the step before"),
        ({"steps": [0, 50, 100]}, "rollout.steps[0]", "0 < p <= 100"),
        ({"steps": [10, 101]}, "rollout.steps[1]", "0 < p <= 100"),
        ({"steps": [10, 2.5, 100]}, "rollout.steps[1]", "whole percent"),
        ({"steps": [10, 50]}, "rollout.steps", "must end at 100"),
        ({"steps": []}, "rollout.steps", "is required"),
        ({"steps": "10,50,100"}, "rollout.steps", "is required"),
        ({"min_samples": 0}, "rollout.min_samples", ">= 1"),
        ({"min_samples": True}, "rollout.min_samples", "whole number"),
        ({"min_duration": "10 minutes"}, "rollout.min_duration", 'like "30s"'),
        ({"min_duration": 600}, "rollout.min_duration", 'like "30s"'),
        ({"min_duration": "9d"}, "rollout.min_duration", "at most 7 days"),
        ({"on_breach": "panic"}, "rollout.on_breach", "rollback, pause"),
        ({"alpha": 0.7}, "rollout.alpha", "(0, 0.5)"),
        ({"guardrails": []}, "rollout.guardrails", "is required"),
        ({"guardrails": [{"metric": "attainment"}]}, "rollout.guardrails[0]", "needs exactly one of"),
        ({"guardrails": [{"metric": "attainment", "at_least": 1.5}]}, "rollout.guardrails[0]", "share in"),
        ({"guardrails": [{"metric": "joy", "at_least": 0.5}]}, "rollout.guardrails[0]", "quantile like"),
        (
            {"guardrails": [{"metric": "p99_queue_ms", "at_most": 5}]},
            "rollout.guardrails[0].metric",
            "ttft_ms",
        ),
        ({"guardrails": ["attainment"]}, "rollout.guardrails[0]", "must be a mapping"),
        ({"colour": "red"}, "rollout.colour", "unknown field"),
        ({"notify": "https://hooks.example.com/x"}, "rollout.notify", "must be a list"),
    ],
)
def test_each_mistake_is_named_by_its_field_path(rollout_document, change, path, words):
    rollout_document["rollout"].update(change)
    found = errors_of(rollout_document)
    assert path in found, found
    assert any(words in m for m in found[path]), found[path]


def test_a_plan_needs_exactly_two_variants(rollout_document, document):
    document["rollout"] = dict(rollout_document["rollout"], candidate="awq")
    found = errors_of(document)
    assert any("2 variants" in m for m in found["rollout"])


def test_a_plan_that_is_not_a_mapping_is_refused(rollout_document):
    rollout_document["rollout"] = ["awq-fa2"]
    assert "rollout" in errors_of(rollout_document)


def test_sla_target_without_a_target_is_named(rollout_document):
    del rollout_document["sla"]["target"]
    found = errors_of(rollout_document)
    assert any("sla.target" in m for m in found["rollout.guardrails[0]"])


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://user:s3cret@hooks.example.com/x", "credentials"),
        ("ftp://hooks.example.com/x", "valid http(s) URL"),
        ("http://hooks.example.com/x", "must use https"),
        ("http://169.254.169.254/latest/meta-data", "must use https"),
        ("https://169.254.169.254/latest/meta-data", "not on the variant allowlist"),
        ("https://10.0.0.5/hook", "not on the variant allowlist"),
        ("https://hooks.example.com:99999/x", "does not parse"),
        ("", "must be a webhook URL"),
    ],
)
def test_hostile_webhooks_are_refused_with_the_path(rollout_document, url, words):
    rollout_document["rollout"]["notify"] = ["https://hooks.example.com/ok", url]
    found = errors_of(rollout_document, allow=parse_allowlist(["127.0.0.1"]))
    assert list(found) == ["rollout.notify[1]"], found
    assert words in found["rollout.notify[1]"][0]
    assert "s3cret" not in str(found)


def test_webhooks_over_https_or_to_allowlisted_hosts_pass(rollout_document):
    hooks = ["https://hooks.example.com/abc", "http://127.0.0.1:9000/hook", "http://sre-bot.internal/h"]
    rollout_document["rollout"]["notify"] = hooks
    doc = validate_document(rollout_document, allow=parse_allowlist(["127.0.0.0/8", "sre-bot.internal"]))
    assert doc["rollout"]["notify"] == hooks
    # Without the allowlist, plain http is refused.
    assert "rollout.notify[1]" in errors_of(rollout_document, allow=parse_allowlist(["10.9.9.9"]))


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("10m", 600.0), ("1h", 3600.0), ("500ms", 0.5), (" 2 m ", 120.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.django_db
@pytest.mark.engine
def test_the_plan_is_stored_exported_and_applies_back_unchanged(rollout_document, users):
    from experiments.services import apply_document, export_document

    rollout_document["rollout"]["notify"] = ["https://hooks.example.com/abc"]
    first = apply_document(rollout_document, actor=users["product"])
    assert first.created and first.experiment.rollout["candidate"] == "awq-fa2"
    exported = export_document(first.experiment)
    assert exported["rollout"] == validate_document(rollout_document)["rollout"]
    again = apply_document(exported, actor=users["product"])
    assert not again.created and again.changes == []
    exported["rollout"]["steps"] = [5, 25, 100]
    changed = apply_document(exported, actor=users["product"])
    assert any(c.startswith("rollout:") for c in changed.changes)
    changed.experiment.refresh_from_db()
    assert changed.experiment.rollout["steps"] == [5, 25, 100]
    del exported["rollout"]
    removed = apply_document(exported, actor=users["product"])
    removed.experiment.refresh_from_db()
    assert removed.experiment.rollout is None and "rollout" not in export_document(removed.experiment)
