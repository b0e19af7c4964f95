"""Variant secrets are bound to hosts and teams by the operator (``_bindings.json`` in
ABPLAT_VARIANT_SECRETS_DIR, docs/security.md): a document naming a secret is refused at save
unless the binding lets its team send it to the variant's host, and the one function that reads
a secret for a connection refuses too, so the gateway, replays, the preflight, prompt planning and
metric scrapes never send a token where its binding does not allow."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from experiments import services
from experiments.document import DocumentError, validate_document
from experiments.models import Experiment, Variant
from streaming import egress
from streaming.egress import SecretError
from workers.models import ReplayRun

TOKEN = "sk-bound-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def _secrets(directory: Path, bindings, names=("vllm-key", "other-key")) -> Path:
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text(TOKEN + "\n")
    if bindings is not None:
        text = bindings if isinstance(bindings, str) else json.dumps(bindings)
        (directory / "_bindings.json").write_text(text)
    return directory


def _bearer(directory, name="vllm-key", url="http://vllm-a.internal:8000/v1", team="search"):
    return egress.bound_bearer(str(directory), name, url=url, team=team)


# --- the rules (pure) ----------------------------------------------------------------------------

BINDING = {
    "vllm-key": {"hosts": ["vllm-a.internal", "*.serving.internal", "10.20.0.0/16"], "teams": ["search"]}
}


@pytest.mark.parametrize(
    "url",
    [
        "http://vllm-a.internal:8000/v1",
        "https://VLLM-A.internal./v1",
        "http://b.serving.internal/v1",
        "http://10.20.3.4:8000/v1",
        "http://[::ffff:10.20.0.9]:80/v1",
    ],
)
def test_a_bound_secret_goes_to_the_hosts_of_its_binding(tmp_path, url):
    assert _bearer(_secrets(tmp_path, BINDING), url=url) == {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "url, host",
    [
        ("http://evil.example/v1", "evil.example"),
        ("http://vllm-a.internal.evil.example/v1", "vllm-a.internal.evil.example"),
        ("http://serving.internal/v1", "serving.internal"),  # *.domain is the names under it
        ("http://10.21.0.1/v1", "10.21.0.1"),
        # A name is judged as a name: networks bind IP addresses written in the endpoint, so DNS
        # cannot move a token into a bound network's neighbourhood or out of it.
        ("http://inside.example/v1", "inside.example"),
    ],
)
def test_a_bound_secret_is_refused_for_any_other_host(tmp_path, url, host):
    with pytest.raises(SecretError) as info:
        _bearer(_secrets(tmp_path, BINDING), url=url)
    message = str(info.value)
    assert "'vllm-key'" in message and repr(host) in message and TOKEN not in message


def test_a_bound_secret_is_refused_for_a_team_its_binding_does_not_name(tmp_path):
    directory = _secrets(tmp_path, BINDING)
    with pytest.raises(SecretError, match="team 'ads'"):
        _bearer(directory, team="ads")
    _secrets(tmp_path, {"vllm-key": {"hosts": ["vllm-a.internal"], "teams": ["*"]}})
    assert _bearer(directory, team="ads")  # "*": every team


@pytest.mark.parametrize("bindings", [None, {}, {"other-key": BINDING["vllm-key"]}])
def test_a_secret_without_a_binding_is_refused_saying_what_the_operator_adds(tmp_path, bindings):
    with pytest.raises(SecretError) as info:
        _bearer(_secrets(tmp_path, bindings))
    message = str(info.value)
    assert "'vllm-key'" in message and "_bindings.json" in message and "ABPLAT_VARIANT_SECRETS_DIR" in message
    assert TOKEN not in message


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (json.dumps({"../x": {"hosts": ["a.internal"], "teams": ["*"]}}), "'../x'"),
        (json.dumps({"k": ["a.internal"]}), "'k': must be an object"),
        (json.dumps({"k": {"hosts": [], "teams": ["*"]}}), "'k'.hosts"),
        (json.dumps({"k": {"hosts": "a.internal", "teams": ["*"]}}), "'k'.hosts"),
        (json.dumps({"k": {"hosts": ["a b"], "teams": ["*"]}}), "'k'.hosts"),
        (json.dumps({"k": {"hosts": ["a.internal"]}}), "'k'.teams"),
        (json.dumps({"k": {"hosts": ["a.internal"], "teams": ["Search Team"]}}), "'k'.teams"),
        (json.dumps({"k": {"hosts": ["a.internal"], "teams": ["*"], "port": 1}}), "'k'.port"),
    ],
)
def test_a_bad_bindings_file_is_refused_naming_the_entry(tmp_path, text, says):
    with pytest.raises(SecretError) as info:
        _bearer(_secrets(tmp_path, text))
    assert says in str(info.value) and "_bindings.json" in str(info.value)
    assert TOKEN not in str(info.value)


def test_the_bindings_file_is_never_a_secret_name(document):
    with pytest.raises(SecretError):
        egress.check_secret_name("_bindings.json")
    document["variants"][0]["auth"] = {"secret": "_bindings.json"}
    with pytest.raises(DocumentError) as info:
        validate_document(document)
    assert [e.path for e in info.value.errors] == ["variants[0].auth.secret"]


def test_every_secret_read_goes_through_the_binding_check():
    """read_secret (the file) has one caller, bound_bearer, next to it: every connection's
    Authorization comes from the function that checks the binding."""
    callers = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "tests", "var") or rel.as_posix() == "streaming/egress.py":
            continue
        if re.search(r"\bread_secret\b", path.read_text(errors="replace")):
            callers.append(rel.as_posix())
    assert callers == []
    source = (ROOT / "streaming" / "egress.py").read_text()
    assert source.count("read_secret(") == 2  # its definition and bound_bearer's call


# --- checked when a document is saved ------------------------------------------------------------


@pytest.fixture
def secrets(settings, tmp_path):
    """vllm-key bound to 127.0.0.1 for the default team (where the test users work)."""
    directory = _secrets(tmp_path / "secrets", {"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["default"]}})
    settings.VARIANT_SECRETS_DIR = str(directory)
    return directory


def _post(client_for, document, secret="vllm-key", role="product"):
    document["variants"][0]["auth"] = {"secret": secret}
    return client_for(role).post("/api/experiments/", document, format="json")


@pytest.mark.django_db
def test_a_bound_secret_is_accepted(secrets, client_for, document):
    response = _post(client_for, document)
    assert response.status_code == 201, response.json()
    assert Variant.objects.get(key="fp16").auth_secret == "vllm-key"


@pytest.mark.django_db
def test_a_secret_sent_to_another_host_is_refused_at_save_naming_the_field(secrets, client_for, document):
    secrets.joinpath("_bindings.json").write_text(
        json.dumps({"vllm-key": {"hosts": ["localhost"], "teams": ["default"]}})
    )
    response = _post(client_for, document)
    assert response.status_code == 400
    [message] = response.json()["variants[0].auth.secret"]
    assert "'127.0.0.1'" in message and "localhost" in message and TOKEN not in response.content.decode()
    assert not Experiment.objects.exists()


@pytest.mark.django_db
def test_an_unbound_secret_is_refused_at_save_saying_what_to_add(secrets, client_for, document):
    response = _post(client_for, document, secret="other-key")
    assert response.status_code == 400
    [message] = response.json()["variants[0].auth.secret"]
    assert "_bindings.json" in message and '"other-key"' in message and '"127.0.0.1"' in message
    assert not Experiment.objects.exists()


@pytest.mark.django_db
def test_a_secret_of_another_team_is_refused_at_save(secrets, client_for, document):
    secrets.joinpath("_bindings.json").write_text(
        json.dumps({"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["ads", "billing"]}})
    )
    response = _post(client_for, document)
    assert response.status_code == 400
    [message] = response.json()["variants[0].auth.secret"]
    assert "team 'default'" in message and "ads" not in message and "billing" not in message


@pytest.mark.django_db
def test_no_secrets_directory_refuses_a_secret_at_save(settings, client_for, document):
    settings.VARIANT_SECRETS_DIR = ""
    response = _post(client_for, document)
    assert response.status_code == 400
    assert "ABPLAT_VARIANT_SECRETS_DIR" in response.json()["variants[0].auth.secret"][0]


@pytest.mark.django_db
def test_moving_a_bound_variant_to_another_host_or_team_is_refused(secrets, client_for, document, users):
    assert _post(client_for, document).status_code == 201
    patched = {
        "variants": [
            {**document["variants"][0], "endpoint": "http://127.0.0.2:8100/v1"},
            *document["variants"][1:],
        ]
    }
    response = client_for("product").patch("/api/experiments/ttft-opt/", patched, format="json")
    assert response.status_code == 400 and "variants[0].auth.secret" in response.json()
    from experiments.models import Team

    Team.objects.create(name="ads").members.add(users["product"])
    with pytest.raises(DocumentError) as info:
        services.apply_document({**document, "team": "ads"}, actor=users["product"])
    assert [e.path for e in info.value.errors] == ["variants[0].auth.secret"]
    assert Variant.objects.get(key="fp16").endpoint == "http://127.0.0.1:8100/v1"


@pytest.mark.django_db
def test_the_command_line_and_the_admin_refuse_it_too(secrets, document, tmp_path, users):
    document["variants"][0]["auth"] = {"secret": "other-key"}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(document))
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("apply_experiment", str(path), "--json", stdout=out)
    assert json.loads(out.getvalue())["error"]["field"] == "variants[0].auth.secret"
    from tests.foundation.test_admin import form_data

    data = form_data(document)
    data["variants-0-auth_secret"] = "other-key"
    client = Client()
    client.force_login(users["product"])
    response = client.post("/admin/experiments/experiment/add/", data)
    assert response.status_code == 200 and "variants[0].auth.secret" in response.content.decode()
    assert not Experiment.objects.exists()


# --- checked again on every connection -----------------------------------------------------------


@pytest.fixture
def saved(secrets, client_for, document):
    """The test document saved with its control naming vllm-key (bound), then the control's
    endpoint moved to 127.0.0.2 behind the document rules' back (a row from before bindings,
    or an edit of the database): the binding does not cover it."""
    assert _post(client_for, document).status_code == 201
    Variant.objects.filter(key="fp16").update(endpoint="http://127.0.0.2:8100/v1")
    return Experiment.objects.get(key="ttft-opt")


def _refusal(exc_info) -> str:
    message = str(exc_info.value)
    assert "'vllm-key'" in message and TOKEN not in message
    return message


@pytest.mark.django_db
def test_replay_clients_and_prompt_planning_refuse_an_unbound_host(saved):
    from workers import variants as variant_clients

    variant = Variant.objects.get(key="fp16")
    with pytest.raises(SecretError) as info:
        variant_clients.client_for(variant)
    assert "'127.0.0.2'" in _refusal(info)
    counter, why = asyncio.run(
        variant_clients.counter_for(list(saved.variants.all()))(variant.endpoint, variant.model, variant.api)
    )
    assert counter is None and "'127.0.0.2'" in why and TOKEN not in why


@pytest.mark.django_db
def test_the_preflight_refuses_an_unbound_host_before_sending(saved):
    from workers import preflight

    variant = Variant.objects.get(key="fp16")
    target = preflight.Target(
        variant.key, variant.endpoint, variant.model, auth_secret="vllm-key", team="default"
    )
    problem = preflight.probe(target)
    assert problem.startswith("variant 'fp16': ") and "'127.0.0.2'" in problem and TOKEN not in problem


@pytest.mark.django_db
def test_the_gateway_holds_no_header_for_an_unbound_host(saved):
    from gateway.variants import load_targets

    Experiment.objects.filter(pk=saved.pk).update(status="running")  # the gateway serves running ones
    target = load_targets()["ttft-opt"].variants["fp16"]
    assert dict(target.headers) == {} and "'127.0.0.2'" in target.error and TOKEN not in target.error


@pytest.mark.django_db
def test_metric_scrapes_refuse_an_unbound_host(saved):
    from workers.server_metrics import Scraper

    run = ReplayRun.objects.create(experiment=saved, source="x")
    scraper = Scraper(run, run.replay_variants(), 1.0, store=object())
    assert isinstance(scraper.fetchers["fp16"], str) and "'127.0.0.2'" in scraper.fetchers["fp16"]
    assert not isinstance(scraper.fetchers["awq"], str)  # no secret, nothing to refuse


@pytest.mark.django_db
def test_a_binding_narrowed_after_save_takes_effect_at_the_next_connection(secrets, client_for, document):
    from workers import variants as variant_clients

    assert _post(client_for, document).status_code == 201
    variant = Variant.objects.get(key="fp16")
    client = variant_clients.client_for(variant)
    asyncio.run(client.aclose())
    secrets.joinpath("_bindings.json").write_text(
        json.dumps({"vllm-key": {"hosts": ["127.0.0.1"], "teams": ["ads"]}})  # the team revoked
    )
    with pytest.raises(SecretError) as info:
        variant_clients.client_for(Variant.objects.get(key="fp16"))
    assert "team 'default'" in _refusal(info)


# --- the system check ------------------------------------------------------------------------------


def test_the_system_check_names_a_bad_bindings_file(settings, tmp_path):
    from experiments.checks import check_variant_egress

    settings.VARIANT_SECRETS_DIR = str(_secrets(tmp_path, {"k": {"hosts": ["a b"], "teams": ["*"]}}))
    found = check_variant_egress()
    assert [m.id for m in found] == ["abplat.E003"] and "'k'.hosts" in found[0].msg
    _secrets(tmp_path, {"k": {"hosts": ["a.internal"], "teams": ["*"]}})
    assert check_variant_egress() == []
