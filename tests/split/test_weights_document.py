"""The weights document: strict validation naming the field, build/rebalance, preview."""

from __future__ import annotations

import json

import pytest

from experiments.assignment import allocate
from experiments.weights.document import (
    WeightsDocument,
    build_document,
    parse_document,
    preview_move,
)
from experiments.weights.errors import ConflictError, WeightsError


def make(weights=None, previous=None, **kw) -> WeightsDocument:
    return build_document(
        kw.pop("experiment", "ttft-opt"),
        weights or {"fp16": 34, "awq": 33, "awq-fa2": 33},
        salt=kw.pop("salt", "9f2c1a7b"),
        control=kw.pop("control", "fp16"),
        actor=kw.pop("actor", "sam"),
        reason=kw.pop("reason", "start"),
        previous=previous,
        at=kw.pop("at", "2025-01-31T12:00:00.000Z"),
    )


def raw(**changes) -> dict:
    data = make().to_json()
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return data


def errors_of(data, expected_key=None) -> list[str]:
    with pytest.raises(WeightsError) as info:
        parse_document(data, expected_key=expected_key)
    return info.value.errors


def test_a_built_document_round_trips_through_bytes():
    doc = make()
    again = parse_document(doc.dumps(), expected_key="ttft-opt")
    assert again == doc
    assert again.to_json() == doc.to_json()
    assert json.loads(doc.dumps())["allocation"]["runs"] == [[0, 3400], [1, 3300], [2, 3300]]


def test_document_weights_cannot_be_mutated_through_a_shared_snapshot():
    doc = make()
    with pytest.raises(TypeError):
        doc.weights["fp16"] = 100  # type: ignore[index]


def test_next_document_rebalances_the_previous_table_and_previews_the_move():
    first = make()
    second = make({"fp16": 50, "awq": 30, "awq-fa2": 20}, previous=first, reason="ramp fp16")
    preview = preview_move(first, second)
    assert preview.moved_share == pytest.approx(0.16)
    assert preview.minimum_share == pytest.approx(0.16)
    assert "16.00% of users change variant" in preview.describe()
    assert preview_move(None, first).moved_share == 0


def test_changing_the_salt_of_an_existing_experiment_is_refused():
    first = make()
    with pytest.raises(WeightsError, match="salt: .* would reshuffle every user"):
        make(previous=first, salt="another")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"weights": {"fp16": 34, "awq": 33, "awq-fa2": 34}}, "weights: weights must sum to 100"),
        ({"weights": {"fp16": 34, "awq": -1, "awq-fa2": 67}}, "weights.awq: must be >= 0, got -1"),
        ({"weights": {"fp16": 34.5, "awq": 32.5, "awq-fa2": 33}}, "weights.fp16: must be an integer"),
        ({"control": "gptq"}, "control: 'gptq' is not one of the variants"),
        ({"salt": ""}, "salt: must be a non-empty string"),
        ({"schema_version": 2}, "schema_version: this code reads version 1, got 2"),
        ({"hash_version": 9}, "hash_version: unsupported version 9"),
        ({"experiment": "bad key!"}, "experiment: must be a slug"),
        ({"at": "yesterday"}, "at: not an ISO 8601 timestamp"),
        ({"at": "2025-01-31T12:00:00"}, "at: must carry a timezone"),
        ({"actor": 7}, "actor: must be a non-empty string, got 7"),
        ({"reason": ...}, "document: missing fields ['reason']"),
        ({"extra": 1}, "document: unknown fields ['extra']"),
        (
            {"allocation": allocate({"fp16": 50, "awq": 25, "awq-fa2": 25}).to_json()},
            "allocation: gives 'fp16' 5000 of 10000 buckets but weights.fp16 = 34 needs 3400",
        ),
        (
            {"allocation": allocate({"fp16": 34, "awq": 66}).to_json()},
            "allocation.variants: ['awq', 'fp16'] differ from the weights' variants",
        ),
        (
            {"allocation": {"n_buckets": 10_000, "variants": ["fp16"], "runs": "x"}},
            "allocation.runs: must be a list",
        ),
    ],
)
def test_invalid_document_is_rejected_with_the_field_path(changes, message):
    errors = errors_of(raw(**changes))
    assert any(message in e for e in errors), errors


def test_document_stored_under_another_key_is_rejected():
    errors = errors_of(make().dumps(), expected_key="other-exp")
    assert errors == ["experiment: 'ttft-opt' does not match the key it is stored under 'other-exp'"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{not json", "document: not valid JSON (Expecting property name"),
        (b"\xff\xfe", "document: not UTF-8"),
        (b"[1, 2]", "document: must be a JSON object, got list"),
        (b"", "document: not valid JSON"),
    ],
)
def test_malformed_bytes_are_rejected_with_a_reason(data, message):
    assert message in errors_of(data)[0]


def test_every_problem_is_reported_at_once():
    errors = errors_of(raw(salt="", control="nope", actor=""))
    assert len(errors) == 3


def test_conflict_error_says_what_changed_and_what_to_do():
    assert "expected revision 5, but it is now at revision 7; reload" in str(ConflictError("ttft-opt", 5, 7))
    assert "already exists at revision 3" in str(ConflictError("ttft-opt", 0, 3))
    assert "does not exist" in str(ConflictError("ttft-opt", 4, 0))
