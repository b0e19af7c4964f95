"""The experiment document rules, shared by the API, the command line and the admin."""

import pytest

from experiments.document import DocumentError, validate_document


def errors_of(doc) -> dict[str, list[str]]:
    with pytest.raises(DocumentError) as info:
        validate_document(doc)
    return info.value.as_dict()


def test_valid_document_is_normalized(document):
    doc = validate_document(document)
    assert [v["key"] for v in doc["variants"]] == ["fp16", "awq", "awq-fa2"]
    assert doc["variants"][1]["control"] is False  # defaulted
    assert doc["variants"][1]["http2"] is False
    assert doc["sla"] == {"ttft_ms": 200.0, "tpot_ms": None, "e2e_ms": None, "target": 0.992}


def test_error_names_the_field_path_and_rule(document):
    document["variants"][2]["weight"] = -1
    assert "variants[2].weight" in errors_of(document)


@pytest.mark.parametrize("weight", [1.5, "33", True, None, -3])
def test_weight_must_be_a_non_negative_integer(document, weight):
    document["variants"][1]["weight"] = weight
    assert "non-negative whole number" in errors_of(document)["variants[1].weight"][0]


def test_weights_must_sum_to_100(document):
    document["variants"][0]["weight"] = 30
    assert "sum to 100" in errors_of(document)["variants"][0]


def test_exactly_one_control(document):
    document["variants"][1]["control"] = True
    assert "exactly one" in errors_of(document)["variants"][0]
    document["variants"][0]["control"] = document["variants"][1]["control"] = False
    assert "found none" in errors_of(document)["variants"][0]


def test_variant_keys_unique(document):
    document["variants"][2]["key"] = "awq"
    assert "duplicates variants[1].key" in errors_of(document)["variants[2].key"][0]


@pytest.mark.parametrize(
    "endpoint", ["ftp://x/v1", "127.0.0.1:8000", "http:///v1", "http://h:99999/v1", "", "http://h/v1?x=1"]
)
def test_endpoint_must_be_http_url(document, endpoint):
    document["variants"][0]["endpoint"] = endpoint
    assert "variants[0].endpoint" in errors_of(document)


@pytest.mark.parametrize(
    "sla, path",
    [
        ({"ttft_ms": 200, "target": 1.0}, "sla.target"),
        ({"ttft_ms": 200, "target": 0}, "sla.target"),
        ({"ttft_ms": -5, "target": 0.9}, "sla.ttft_ms"),
        ({"ttft_ms": float("nan"), "target": 0.9}, "sla.ttft_ms"),
        ({"target": 0.9}, "sla.ttft_ms"),
        ({"ttft_ms": 200}, "sla.target"),
        ({"ttft_ms": 200, "target": 0.9, "tpot_ms": 0}, "sla.tpot_ms"),
        ({"ttft_ms": 200, "target": 0.9, "p99": 3}, "sla.p99"),
    ],
)
def test_sla_values_in_range(document, sla, path):
    document["sla"] = sla
    assert path in errors_of(document)


def test_factors_must_have_the_same_names_everywhere(document):
    document["variants"][2]["factors"] = {"quantization": "awq"}
    errors = errors_of(document)
    assert "must name the same factors" in errors["variants[2].factors"][0]


def test_unknown_fields_are_rejected(document):
    document["colour"] = "blue"
    document["variants"][0]["wieght"] = 3
    errors = errors_of(document)
    assert "colour" in errors and "variants[0].wieght" in errors


def test_all_errors_reported_at_once(document):
    document["key"] = "Bad Key"
    document["variants"][0]["api"] = "grpc"
    document["variants"][1]["model"] = ""
    assert {"key", "variants[0].api", "variants[1].model"} <= set(errors_of(document))


@pytest.mark.parametrize("raw", [None, [], "text", {"key": "x"}])
def test_non_documents_rejected(raw):
    with pytest.raises(DocumentError):
        validate_document(raw)


def test_an_empty_optional_hypothesis_is_no_hypothesis(document):
    document["hypothesis"] = None  # what YAML gives for `hypothesis:` with nothing after it
    assert validate_document(document)["hypothesis"] == ""


def test_a_missing_name_is_still_required(document):
    document["name"] = None
    assert errors_of(document)["name"] == ["is required"]


@pytest.mark.parametrize("where", ["top", "variant"])
def test_a_malformed_key_says_what_is_wrong_not_that_it_is_missing(document, where):
    target = document if where == "top" else document["variants"][1]
    path = "key" if where == "top" else "variants[1].key"
    target["key"] = "Bad_Key"
    message = errors_of(document)[path][0]
    assert "required" not in message
    assert message.startswith("must be lowercase letters") and "'Bad_Key'" in message
    del target["key"]
    assert errors_of(document)[path][0].startswith("is required")


def test_engine_args_accept_vllms_dashed_flag_names(document):
    document["variants"][1]["engine_args"] = {"max-model-len": 4096, "--enable-chunked-prefill": True}
    doc = validate_document(document)
    assert doc["variants"][1]["engine_args"] == {"max_model_len": 4096, "enable_chunked_prefill": True}


def test_engine_args_given_in_both_spellings_are_rejected(document):
    document["variants"][1]["engine_args"] = {"max-model-len": 4096, "max_model_len": 2048}
    assert "given twice" in errors_of(document)["variants[1].engine_args.max_model_len"][0]


def test_engine_arg_names_with_other_characters_are_still_rejected(document):
    document["variants"][1]["engine_args"] = {"max.model.len": 1}
    assert "dashed flag spelling" in errors_of(document)["variants[1].engine_args.max.model.len"][0]


def test_a_variant_cost_is_normalized_and_defaults_to_usd(document):
    document["variants"][2]["cost"] = {"per_hour": 4}
    document["variants"][1]["cost"] = {"per_hour": 2.5, "currency": "EUR"}
    doc = validate_document(document)
    assert doc["variants"][2]["cost"] == {"per_hour": 4.0, "currency": "USD"}
    assert doc["variants"][1]["cost"] == {"per_hour": 2.5, "currency": "EUR"}
    assert doc["variants"][0]["cost"] is None  # no price given: capacity without cost


@pytest.mark.parametrize(
    "cost, path, words",
    [
        ({"per_hour": 0}, "variants[0].cost.per_hour", "above 0"),
        ({"per_hour": -1.0}, "variants[0].cost.per_hour", "above 0"),
        ({"per_hour": float("nan")}, "variants[0].cost.per_hour", "above 0"),
        ({"per_hour": "4.20"}, "variants[0].cost.per_hour", "number"),
        ({"per_hour": True}, "variants[0].cost.per_hour", "number"),
        ({"per_hour": 1e9}, "variants[0].cost.per_hour", "at most"),
        ({"per_hour": 4.2, "currency": "usd"}, "variants[0].cost.currency", "ISO 4217"),
        ({"per_hour": 4.2, "currency": "DOLLARS"}, "variants[0].cost.currency", "ISO 4217"),
        ({"per_hour": 4.2, "per_day": 100}, "variants[0].cost.per_day", "unknown field"),
        ("4.20 USD", "variants[0].cost", "mapping"),
    ],
)
def test_a_bad_cost_is_named_by_its_field_path(document, cost, path, words):
    document["variants"][0]["cost"] = cost
    errors = errors_of(document)
    assert path in errors and words in " ".join(errors[path]), errors


@pytest.mark.engine
def test_the_cost_is_stored_exported_and_applies_back_unchanged(document, db):
    from experiments import services

    document["variants"][0]["cost"] = {"per_hour": 4.2, "currency": "USD"}
    exp = services.apply_document(document).experiment
    exported = services.export_document(exp)
    assert exported["variants"][0]["cost"] == {"per_hour": 4.2, "currency": "USD"}
    assert exported["variants"][1]["cost"] is None
    again = services.apply_document(exported)
    assert not again.created and again.changes == []
