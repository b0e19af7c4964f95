"""Schemathesis fuzzes the API from its own OpenAPI schema, in-process.

The schema is the one the app serves at /api/schema/, fetched through the WSGI application;
every operation in it is called with generated valid ("positive") and invalid ("negative")
requests as each role (product, analyst, sre, anonymous), on a database holding a draft and a
running experiment, a replay run and a trace, so that generated paths reach real objects too;
and another team's running experiment with a run and a capacity search, which product and
analyst callers meet as a 404 (tests/foundation/test_teams.py says so for each endpoint).
Generated documents name teams (``team``) and secrets, checked against a secrets directory with
a bindings file.
Checks on every response:

- no 5xx;
- a status the schema documents has the body and content type the schema documents (the
  schema documents no 4xx, so schemathesis' status_code_conformance is not checked);
- a 4xx says what was wrong: a JSON body with a non-empty ``detail`` or errors keyed by field.
  Only Django's own 404 for a path no URL pattern matches (``/api/experiments/a%20b/``) is
  HTML: no API view ran.

Deterministic (derandomized, fixed example counts) and bounded for CI. Nothing leaves the
machine: a replay the fuzzer manages to start is recorded but never launched (its preflight
probes loopback variants only), and no host name but localhost resolves.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import re
import socket
import urllib.parse

import pytest
import schemathesis
from django.apps import apps
from django.urls import Resolver404, resolve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from abplat.wsgi import application
from capacity.models import CapacitySearch
from experiments import services
from experiments.models import Team
from traces import storage
from workers.models import ReplayRun

ROLES = ["product", "analyst", "sre", None]
# Examples per operation and generation mode (24 operations, most in both modes): product and
# sre reach the write paths; analyst and anonymous callers mostly meet 403 and 401. About 90 s.
EXAMPLES = {"product": 18, "analyst": 6, "sre": 18, None: 3}
TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:01.5,11,5\n2023-11-16 18:17:03.5,10,5\n"
PATH_PARAMETER = re.compile(r"{(\w+)}")


def says_what_was_wrong(ctx, response, case):
    """A 4xx names the problem: JSON with a non-empty ``detail`` or non-empty field errors."""
    if not 400 <= response.status_code < 500:
        return None
    content_type = response.headers.get("content-type", [""])[0]
    if not content_type.startswith("application/json"):
        # Django's 404 page for a path that no URL pattern matches: no API view ran.
        assert response.status_code == 404 and _unrouted(case.formatted_path), (
            f"{response.status_code} from an API view answered {content_type!r}, not JSON"
        )
        return None
    body = json.loads(response.text)
    assert isinstance(body, dict) and body, f"{response.status_code} with nothing in it: {body!r}"
    if "detail" in body:  # a message, perhaps with context (a 409 shows the run's state)
        detail = body["detail"]
        assert isinstance(detail, str) and detail.strip(), f"empty detail: {body!r}"
    else:  # errors keyed by field path, each naming what is wrong
        for field, errors in body.items():
            assert errors, f"field {field!r} with no error: {body!r}"
    return None


def _unrouted(path: str) -> bool:
    try:
        resolve(urllib.parse.unquote(path))
    except Resolver404:
        return True
    return False


CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.response_schema_conformance,
    openapi_checks.content_type_conformance,
    says_what_was_wrong,
]


def _loopback_only(getaddrinfo):
    def lookup(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in (None, "localhost") and not _ip_literal(name):
            raise socket.gaierror(socket.EAI_NONAME, f"{name!r}: name lookups are off in the fuzz tests")
        return getaddrinfo(host, *args, **kwargs)

    return lookup


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]").partition("%")[0])
    except ValueError:
        return False
    return True


@pytest.fixture
def world(users, experiment, document, sample_store, settings, tmp_path, monkeypatch):
    """What generated paths may name: a draft and a running experiment, a run, a trace, another
    team's running experiment with its run and capacity search; and a migrated (empty) sample
    store for the report."""
    # transaction=True flushes what the data migrations granted; grant trace reading again.
    importlib.import_module("traces.migrations.0002_roles_read_traces").grant_trace_roles(apps, None)
    # Fuzzing sends hundreds of requests a minute per user: rates are tested elsewhere.
    settings.API_THROTTLE_USER = settings.API_THROTTLE_ANON = "1000000/min"
    settings.TRACE_DIR = tmp_path / "traces"
    # A replay the fuzzer starts is recorded, never sent (the preflight still probes loopback).
    monkeypatch.setattr("workers.service.start_in_background", lambda handle, daemon: None)
    # Likewise a capacity search: recorded, never run.
    monkeypatch.setattr("capacity.tasks.start_in_background", lambda search_id: None)
    # Generated endpoints name random hosts: no lookup of them leaves the machine.
    monkeypatch.setattr(socket, "getaddrinfo", _loopback_only(socket.getaddrinfo))
    # Secrets named in generated documents meet the operator's bindings (one secret, bound).
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "vllm-key").write_text("sk-fuzz-0123456789\n")
    (secrets / "_bindings.json").write_text('{"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["default"]}}')
    settings.VARIANT_SECRETS_DIR = str(secrets)
    live = services.apply_document({**document, "key": "live"}, actor=users["product"]).experiment
    services.transition(live, "start", users["product"])
    run = ReplayRun.objects.create(experiment=live, source="x")
    # Another team's: the operator makes it (no user), in a team none of the callers is in.
    Team.objects.create(name="elsewhere")
    hidden = services.apply_document({**document, "key": "hidden", "team": "elsewhere"}).experiment
    services.transition(hidden, "start", None)
    hidden_run = ReplayRun.objects.create(experiment=hidden, source="x")
    hidden_search = CapacitySearch.objects.create(experiment=hidden)
    trace, _ = storage.store([TRACE.encode()], name="tiny.csv")
    return {
        "key": [experiment.key, live.key, hidden.key],
        "id": [run.pk, hidden_run.pk, hidden_search.pk],
        "ref": [trace.sha256, trace.name],
    }


# Bodies that get past the first check, to reach the deeper ones: a replay of the running
# experiment's uploaded trace, without the preflight (its other fields generated).
BODY_HINTS = {
    ("POST", "/api/replays/"): ({"experiment": "live", "trace": "tiny.csv", "preflight": False}, ["source"]),
    ("POST", "/api/capacity/"): ({"experiment": "live", "trace": "tiny.csv"}, []),
}


def operation_cases(operation, mode: GenerationMode, world: dict):
    """Generated requests; some with path parameters naming objects that exist, or with the
    body hinted (BODY_HINTS)."""
    generated = operation.as_strategy(generation_mode=mode)
    cases = [generated]
    names = PATH_PARAMETER.findall(operation.path)
    if names and all(name in world for name in names):
        existing = st.fixed_dictionaries({name: st.sampled_from(world[name]) for name in names})
        cases.append(
            existing.flatmap(
                lambda values: operation.as_strategy(generation_mode=mode, path_parameters=values)
            )
        )
    if hint := BODY_HINTS.get((operation.method.upper(), operation.path)):
        cases.append(generated.map(lambda case: _hinted(case, *hint)))
    return st.one_of(*cases)


def _hinted(case, fields: dict, drop: list[str]):
    if isinstance(case.body, dict):
        for name in drop:
            case.body.pop(name, None)
        case.body.update(fields)
    return case


def negatable(operation) -> bool:
    """Whether a request to it can be made invalid: a free-form string in the path cannot."""
    if len(operation.body) or len(operation.query):
        return True
    return any(p.definition.get("schema", {}).get("type") != "string" for p in operation.path_parameters)


def fuzz(operation, mode: GenerationMode, headers: dict[str, str], world: dict, examples: int) -> str | None:
    """Run one operation's examples: the failure report, or None.

    A Hypothesis test per operation, built here: schemathesis' own pytest integration
    (``schemathesis.pytest.from_fixture``) fails under pytest 9.2 ("'Function' object has no
    attribute '_nodeid'")."""

    @given(case=operation_cases(operation, mode, world))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        case.call_and_validate(headers=headers, checks=CHECKS)

    try:
        run()
    except Unsatisfiable:
        return None  # nothing in this operation can be made invalid (a free-form path parameter)
    except (Exception, FailureGroup) as exc:  # report every operation's failures at the end
        return f"{operation.label} ({mode.value}):\n{exc}"
    return None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.parametrize("role", ROLES, ids=lambda role: role or "anonymous")
@pytest.mark.engine
def test_every_operation_survives_fuzzing_as_each_role(role, users, world):
    reader = Token.objects.create(user=users["admin"])
    schema = schemathesis.openapi.from_wsgi(
        "/api/schema/?format=json", application, headers={"Authorization": f"Token {reader.key}"}
    )
    headers = {}
    if role is not None:
        headers["Authorization"] = f"Token {Token.objects.create(user=users[role]).key}"
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/api/experiments/", "/api/replays/", "/api/traces/", "/api/capacity/"} <= {
        op.path for op in operations
    }
    failures = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not negatable(operation):
                continue
            if (failure := fuzz(operation, mode, headers, world, EXAMPLES[role])) is not None:
                failures.append(failure)
    assert not failures, "\n\n".join(failures)
