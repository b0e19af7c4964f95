"""Hypothesis at the pure parsers: bad experiment documents, weights documents, trace
lines and report filters only ever raise the parser's own error, and that error names the field
or line at fault; assignment is deterministic and lands in a variant for any user id."""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from analysis.definitions import RUN_STATUSES, Filters, QueryError
from dashboards.filters import filters_from_params
from experiments.assignment import DEFAULT_BUCKETS, allocate, assign, bucket_v1, make_assigner
from experiments.document import TOP_FIELDS, DocumentError, validate_document
from experiments.weights.document import WeightsError, build_document, parse_document
from replay.sources import (
    AZURE_HEADER,
    EXCERPT_MAX,
    Problem,
    SourceError,
    excerpt,
    load_source,
    read_azure,
    read_jsonl,
    sniff_format,
    summarize,
)
from replay.users import UserPopulation
from streaming.egress import parse_allowlist

# 150 examples a property, the same ones on every run: a CI failure reproduces anywhere.
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---- what bad input looks like ------------------------------------------------------------

HUGE_INT = st.integers(min_value=10**300, max_value=10**400) | st.integers(max_value=-(10**300))
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE_INT
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["", " ", "chat", "http://[::1", "http://[::1]:99999/v1", "0", "1e400", "\ud800"])
)
# JSON gives string keys; YAML (`apply_experiment FILE`) also numbers, booleans and null.
KEYS = st.text(max_size=12) | st.integers(-3, 3) | st.booleans() | st.none()
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)
ALLOW = parse_allowlist(["localhost", "127.0.0.0/8", "::1/128"])
VALID_DOCUMENT = {
    "key": "ttft-opt",
    "name": "TTFT optimizations",
    "hypothesis": "AWQ keeps TTFT",
    "sla": {"ttft_ms": 200, "tpot_ms": 50, "target": 0.992},
    "variants": [
        {
            "key": "fp16",
            "control": True,
            "weight": 50,
            "endpoint": "http://127.0.0.1:8100/v1",
            "model": "tiny-llama",
            "api": "chat",
            "factors": {"quantization": "none"},
            "engine_args": {"dtype": "float16"},
        },
        {
            "key": "awq",
            "weight": 50,
            "endpoint": "http://localhost:8101/v1",
            "model": "tiny-llama",
            "api": "completions",
            "http2": True,
            "factors": {"quantization": "awq"},
            "engine_args": {"--max-model-len": 2048},
            "auth": {"secret": "awq-token"},
        },
    ],
}


def containers(value, path=()):
    """(path, container) of every dict and list inside ``value``, itself first."""
    if isinstance(value, dict | list):
        yield path, value
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from containers(item, (*path, key))


@st.composite
def mutated(draw, valid: dict, max_edits: int = 4):
    """``valid`` with a few edits: a value replaced by anything, a field deleted, one added."""
    doc = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, max_edits))):
        _, target = draw(st.sampled_from(list(containers(doc))))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if isinstance(target, list):
            if not target or action == "add":
                target.append(draw(JSONISH))
            elif action == "delete":
                del target[draw(st.integers(0, len(target) - 1))]
            else:
                target[draw(st.integers(0, len(target) - 1))] = draw(JSONISH)
        elif action == "add" or not target:
            target[draw(KEYS)] = draw(JSONISH)
        else:
            key = draw(st.sampled_from(sorted(target, key=repr)))
            if action == "delete":
                del target[key]
            else:
                target[key] = draw(JSONISH)
    return doc


# ---- experiment documents -----------------------------------------------------------------


def check_document(raw, **egress) -> None:
    try:
        doc = validate_document(raw, **egress)
    except DocumentError as exc:
        assert exc.errors, "a DocumentError with no error in it"
        roots = TOP_FIELDS | {"(document)"}
        if isinstance(raw, dict):  # an unknown field is named as given (a blank one quoted)
            roots |= {str(k) for k in raw} | {repr(k) for k in raw}
        for error in exc.errors:
            assert error.path and error.message.strip(), error
            assert any(error.path == r or error.path.startswith((r + ".", r + "[")) for r in roots), (
                f"{error.path!r} names no field"
            )
        json.dumps(exc.as_dict())  # the API's 400 body
        event("refused")
        return
    event("accepted")
    # What it accepts it accepts again, unchanged: the document the API stores and exports.
    assert validate_document(doc, **egress) == doc


@FUZZ
@given(raw=JSONISH)
def test_any_value_as_an_experiment_document_is_accepted_or_refused_by_field(raw):
    check_document(raw)


@FUZZ
@given(raw=mutated(VALID_DOCUMENT), with_allowlist=st.booleans())
@example(raw={**VALID_DOCUMENT, "sla": {"ttft_ms": 10**400, "target": 0.99}}, with_allowlist=False)
@example(raw={**VALID_DOCUMENT, 7: "x", "zz": 1}, with_allowlist=False)
@example(
    raw={**VALID_DOCUMENT, "variants": [{**VALID_DOCUMENT["variants"][0], "endpoint": "http://[::1"}]},
    with_allowlist=True,
)
def test_a_mutated_experiment_document_is_accepted_or_refused_by_field(raw, with_allowlist):
    # The API's rules, with a resolver that knows no name (no lookup leaves the test).
    egress = {"allow": ALLOW, "resolve": lambda host: []} if with_allowlist else {}
    check_document(raw, **egress)


# ---- weights documents --------------------------------------------------------------------

VALID_WEIGHTS = build_document(
    "ttft-opt",
    {"fp16": 34, "awq": 33, "awq-fa2": 33},
    salt="9f2c1a7b",
    control="fp16",
    actor="pat",
    reason="ramp awq",
    at="2025-01-31T12:00:00Z",
)


def check_weights_errors(exc: WeightsError) -> None:
    assert exc.errors
    for error in exc.errors:
        field, sep, message = error.partition(": ")
        assert sep and field and message.strip(), f"{error!r} names no field"


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200) | JSONISH.map(json.dumps))
@example(raw=b"[" * 100_000)
@example(raw=b'{"schema_version": ' + b"1" * 5000 + b"}")
def test_any_bytes_as_a_stored_weights_document_are_refused_by_field(raw):
    try:
        parse_document(raw)
    except WeightsError as exc:
        check_weights_errors(exc)


@FUZZ
@given(raw=mutated(VALID_WEIGHTS.to_json(), max_edits=3))
@example(raw={**VALID_WEIGHTS.to_json(), "weights": {"fp16": 10**400, "awq": -(10**400) + 100}})
@example(raw=VALID_WEIGHTS.to_json())
@example(
    raw={
        **VALID_WEIGHTS.to_json(),
        "weights": {"x": 100},
        "control": "x",
        "allocation": {"n_buckets": 10**12, "variants": ["x"], "runs": [[0, 10**12]]},
    },
)
def test_a_mutated_weights_document_is_accepted_or_refused_by_field(raw):
    try:
        doc = parse_document(json.dumps(raw).encode())
    except WeightsError as exc:
        check_weights_errors(exc)
        return
    event("accepted")
    assert parse_document(doc.dumps()) == doc


@FUZZ
@given(weights=st.dictionaries(st.text(max_size=10), JSONISH, max_size=5) | JSONISH)
def test_any_weights_change_is_built_or_refused_by_field(weights):
    # PUT /api/experiments/{key}/weights hands the body's "weights" to build_document.
    try:
        build_document(
            "ttft-opt", weights, salt="s", control="fp16", actor="sam", reason="r", previous=VALID_WEIGHTS
        )
    except WeightsError as exc:
        check_weights_errors(exc)


# ---- trace lines --------------------------------------------------------------------------


def check_source_error(exc: SourceError, n_lines: int) -> None:
    """Every problem names a line (0: the source as a whole) and quotes it only in short."""
    event("refused")
    text = str(exc)
    assert text.isprintable(), f"unescaped characters in {text!r}"
    for problem in exc.problems:
        assert isinstance(problem, Problem) and 0 <= problem.line <= n_lines + 1, problem
        assert len(problem.message) <= 2 * EXCERPT_MAX + 200, f"a long message: {problem.message!r}"


def check_loaded(loaded) -> None:
    event(f"loaded ({len(loaded.skipped)} skipped)" if loaded.skipped else "loaded")
    for request in loaded.requests:
        assert request.line >= 1 and request.max_tokens >= 1
        # What the parser accepts can be hashed (assignment), sent and stored as UTF-8.
        request.user_id.encode("utf-8")
        assert request.offset_s >= 0


AZURE_FIELDS = st.sampled_from(["2023-11-16 18:17:03.9799600", "2023-11-16 18:17:03", "12", "0", ""])
AZURE_LINE = (
    st.lists(AZURE_FIELDS | st.text(max_size=12), min_size=1, max_size=4).map(",".join)
    | st.text(max_size=40)
    | st.sampled_from(["2023-11-16 18:17:03." + "9" * 5000 + ",1,1", "9999-12-31 23:59:59.9,1,1"])
)
HEADER = st.text(max_size=30) | st.sampled_from(
    [",".join(AZURE_HEADER), "\ufeff" + ",".join(AZURE_HEADER) + "\r"]
)


@FUZZ
@given(header=HEADER, lines=st.lists(AZURE_LINE, max_size=8), on_error=st.sampled_from(["reject", "skip"]))
def test_azure_lines_parse_or_fail_naming_the_line(header, lines, on_error):
    try:
        loaded = read_azure([header, *lines], population=UserPopulation(size=10), on_error=on_error)
    except SourceError as exc:
        check_source_error(exc, len(lines) + 1)
        return
    check_loaded(loaded)


JSONL_VALUES = {
    "timestamp": st.sampled_from([0, 1.5, 10**400, "2024-11-29T17:00:00Z", "nope", None, True, float("nan")])
    | JSONISH,
    "user_id": st.sampled_from(["u1", 7, "", "\ud800", "a\udfffb", None]) | st.text(max_size=8),
    "prompt": st.sampled_from(["hello", "", None]) | JSONISH,
    "messages": st.just([{"role": "user", "content": "hi"}]) | JSONISH,
    "max_tokens": st.sampled_from([1, 0, -1, 10**7, 10**400, 2.5, True]) | JSONISH,
    "metadata": st.just({"k": "v"}) | JSONISH,
}
JSONL_OBJECT = st.fixed_dictionaries(
    {"timestamp": JSONL_VALUES["timestamp"], "max_tokens": JSONL_VALUES["max_tokens"]},
    optional={k: v for k, v in JSONL_VALUES.items() if k not in ("timestamp", "max_tokens")}
    | {"extra\n\x00\u2028": JSONISH},
)
JSONL_GOOD = {"timestamp": 1.5, "user_id": "u1", "prompt": "hello", "max_tokens": 16, "metadata": {"k": "v"}}
JSONL_LINE = (
    st.just(JSONL_GOOD).map(json.dumps)
    | mutated(JSONL_GOOD, max_edits=2).map(json.dumps)
    | JSONL_OBJECT.map(json.dumps)
    | st.text(max_size=40)
    | JSONISH.map(json.dumps)
)


@FUZZ
@given(lines=st.lists(JSONL_LINE, min_size=1, max_size=6), on_error=st.sampled_from(["reject", "skip"]))
@example(lines=['{"timestamp": 1' + "0" * 400 + ', "prompt": "a", "max_tokens": 1}'], on_error="reject")
@example(lines=['{"timestamp": 1, "user_id": "\\ud800", "prompt": "a", "max_tokens": 1}'], on_error="reject")
def test_jsonl_lines_parse_or_fail_naming_the_line(lines, on_error):
    try:
        loaded = read_jsonl(lines, population=UserPopulation(size=10), on_error=on_error)
    except SourceError as exc:
        check_source_error(exc, len(lines))
        return
    check_loaded(loaded)


@FUZZ
@given(
    data=st.binary(max_size=300)
    | st.lists(AZURE_LINE, max_size=5).map(lambda ls: "\n".join([",".join(AZURE_HEADER), *ls]).encode())
    | st.lists(JSONL_LINE, max_size=5).map(lambda ls: "\n".join(ls).encode()),
    fmt=st.sampled_from(["azure", "jsonl"]),
    max_line_bytes=st.none() | st.integers(1, 100),
)
def test_a_trace_file_loads_or_fails_naming_the_line(data, fmt, max_line_bytes):
    # Uploads go through summarize (traces.storage), replays through load_source.
    fd, path = tempfile.mkstemp(prefix="abplat-fuzz-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        n_lines = data.count(b"\n") + 1
        for read in (summarize, load_source):
            kwargs = {"population": UserPopulation(size=10)} if read is load_source else {}
            try:
                result = read(path, fmt, max_line_bytes=max_line_bytes, max_bytes=10_000, name="t", **kwargs)
            except SourceError as exc:  # SourceFileError included (empty, not UTF-8)
                check_source_error(exc, n_lines)
                continue
            if read is load_source:
                check_loaded(result)
        assert sniff_format(data.split(b"\n")[0]) in (None, "azure", "jsonl")
    finally:
        os.unlink(path)


@FUZZ
@given(value=st.text() | st.binary(), limit=st.integers(8, 200))
def test_an_excerpt_is_short_quoted_and_printable(value, limit):
    quoted = excerpt(value, limit)
    assert len(quoted) <= limit and quoted.isprintable()
    assert quoted.startswith("'") and quoted.endswith("'")


# ---- report filters -----------------------------------------------------------------------

PARAM = st.text(max_size=30) | st.sampled_from(
    [
        "1",
        "0",
        "1" * 30,
        "2024-11-29T17:00",
        "2024-11-29T17:00:00Z",
        "9999-12-31T23:59:59-23:59",
        "0001-01-01T00:00:00+14:00",
        "all",
        "done,failed",
        "split",
        "mirror",
    ]
)


@FUZZ
@given(
    get=st.dictionaries(st.sampled_from(["run", "since", "until", "status", "mode", "variant"]), PARAM),
    variants=st.lists(PARAM, max_size=3),
    statuses=st.none() | st.lists(PARAM, max_size=3),
)
@example(get={"since": "9999-12-31T23:59:59-23:59"}, variants=[], statuses=None)
@example(get={"until": "0001-01-01T00:00:00+14:00"}, variants=[], statuses=None)
@example(get={"run": "1" * 5000}, variants=[], statuses=None)
def test_report_parameters_parse_or_fail_naming_the_parameter(get, variants, statuses):
    try:
        filters = filters_from_params("ttft-opt", get, variants, ["fp16", "awq"], statuses)
    except QueryError as exc:
        assert str(exc).strip()
        return
    # What reaches the readers is a UTC instant inside the calendar.
    for when in (filters.since, filters.until):
        assert when is None or when.astimezone(dt.UTC).year >= 1
    assert set(filters.status) <= set(RUN_STATUSES)


@FUZZ
@given(
    experiment=st.text(max_size=10),
    run_id=st.none() | st.integers() | st.booleans(),
    since=st.none() | st.datetimes(timezones=st.timezones() | st.none()),
    until=st.none() | st.datetimes(timezones=st.timezones() | st.none()),
    status=st.lists(st.text(max_size=10) | st.sampled_from(RUN_STATUSES), max_size=3).map(tuple),
    mode=st.none() | st.text(max_size=8) | st.sampled_from(["split", "mirror"]),
)
def test_filters_are_built_or_refused_with_a_query_error(experiment, run_id, since, until, status, mode):
    try:
        Filters(experiment, run_id=run_id, since=since, until=until, status=status, mode=mode)
    except QueryError as exc:
        assert str(exc).strip()


# ---- assignment ---------------------------------------------------------------------------


def _percent(ws: list[int]) -> dict[str, int]:
    """Integer percents summing to 100, in proportion to ``ws`` (the first one non-zero)."""
    ws = [ws[0] + 1, *ws[1:]]
    scaled = [w * 100 // sum(ws) for w in ws]
    scaled[0] += 100 - sum(scaled)
    return {f"v{i}": w for i, w in enumerate(scaled)}


WEIGHTS = st.lists(st.integers(0, 100), min_size=1, max_size=6).map(_percent)


@FUZZ
@given(salt=st.text(max_size=40), user_id=st.text(), weights=WEIGHTS)
@example(salt="ttft-opt:9f2c1a7b", user_id="", weights={"a": 100})
@example(salt="", user_id="\x00\u2028\U0010ffff", weights={"a": 50, "b": 50})
def test_any_user_id_gets_one_variant_every_time(salt, user_id, weights):
    allocation = allocate(weights)
    variant = assign(salt, user_id, allocation)
    assert variant in allocation.variants and weights[variant] > 0
    assert assign(salt, user_id, allocation) == variant
    assert make_assigner(salt, allocation)(user_id) == variant  # the router's fast path agrees
    assert 0 <= bucket_v1(salt, user_id) < DEFAULT_BUCKETS


@pytest.mark.parametrize("user_id", ["\ud800", "a\udfffb"])
def test_a_user_id_that_is_not_unicode_text_never_reaches_assignment(user_id):
    # Lone surrogates cannot be hashed (UTF-8) nor stored: the JSONL reader refuses them.
    line = json.dumps({"timestamp": 1, "user_id": user_id, "prompt": "a", "max_tokens": 1})
    with pytest.raises(SourceError, match="line 1: user_id"):
        read_jsonl([line], population=UserPopulation(size=10))
