"""Teams own experiments: a product user acts only on their teams' experiments, an analyst reads
only theirs, sre and superusers act on all (docs/security.md, "Roles"). Every path: the API (another team's
experiment is a 404, so its name does not leak), the admin, documents (apply_document), the
commands' ``--as``, dashboards, reports, rollouts, capacity and replays."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import Group, User
from django.core.exceptions import PermissionDenied
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from rest_framework.test import APIClient

from capacity.models import CapacitySearch
from experiments import services
from experiments.document import DocumentError
from experiments.models import AuditEntry, Experiment
from workers.models import ReplayRun

KEY = "ttft-opt"


def _team(name: str, *members):
    from experiments.models import Team

    team, _ = Team.objects.get_or_create(name=name)
    team.members.add(*members)
    return team


def _role_user(username: str, role: str) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username, is_staff=True)
    user.groups.add(Group.objects.get(name=role))
    return user


def _api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _web(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def teams(users):
    """Team search (pat, analyst ana) and team ads (product olga, analyst alan); each of them
    in their own team only."""
    olga, alan = _role_user("olga", "product"), _role_user("alan", "analyst")
    people = (users["product"], users["analyst"], olga, alan)
    for user in people:
        user.abplat_teams.clear()
    return SimpleNamespace(
        search=_team("search", users["product"], users["analyst"]),
        ads=_team("ads", olga, alan),
        olga=olga,
        alan=alan,
    )


@pytest.fixture
def theirs(teams, document, users):
    """Team search's experiment, made by pat."""
    return services.apply_document({**document, "team": "search"}, actor=users["product"]).experiment


def _unchanged(experiment) -> None:
    fresh = Experiment.objects.get(pk=experiment.pk)
    assert (fresh.name, fresh.status, fresh.team.name) == (experiment.name, experiment.status, "search")


# --- the API -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_another_teams_experiment_is_a_404_on_every_api_endpoint(theirs, teams, document):
    olga = _api(teams.olga)
    detail = f"/api/experiments/{KEY}/"
    calls = [
        ("get", detail, None),
        ("put", detail, {**document, "name": "hijacked"}),
        ("patch", detail, {"name": "hijacked"}),
        ("delete", detail, None),
        ("get", f"/api/experiments/{KEY}/assign?user_id=u-1", None),
        ("get", f"/api/experiments/{KEY}/report", None),
        *[
            ("post", f"{detail}{action}/", {"reason": "x"})
            for action in ("start", "pause", "resume", "conclude")
        ],
    ]
    for method, url, body in calls:
        response = getattr(olga, method)(url, body, format="json")
        assert response.status_code == 404, (method, url, response.status_code, response.content[:300])
        assert "search" not in response.content.decode()
    _unchanged(theirs)
    # The audit list of a key holds the entries the caller may read: none here, as for a key
    # that never existed.
    audit = olga.get(detail + "audit/")
    assert audit.status_code == 200 and audit.json()["results"] == []
    assert _api(teams.alan).get(detail).status_code == 404  # an analyst of another team
    assert _api(teams.search.members.get(username="pat")).get(detail).status_code == 200


@pytest.mark.django_db
def test_assigning_on_another_teams_running_experiment_reads_as_a_key_without_weights(theirs, teams, users):
    services.transition(theirs, "start", users["product"])
    mine = _api(users["analyst"]).get(f"/api/experiments/{KEY}/assign", {"user_id": "u-1"})
    assert mine.status_code == 200 and mine.json()["variant"] in {"fp16", "awq", "awq-fa2"}
    hidden = _api(teams.alan).get(f"/api/experiments/{KEY}/assign", {"user_id": "u-1"})
    never = _api(teams.alan).get("/api/experiments/never-made/assign", {"user_id": "u-1"})
    assert hidden.status_code == never.status_code == 404
    assert hidden.json()["detail"] == never.json()["detail"].replace("never-made", KEY)


@pytest.mark.django_db
def test_lists_and_the_audit_log_show_only_the_callers_teams(theirs, teams, users):
    def keys(user, query=""):
        response = _api(user).get("/api/experiments/" + query)
        assert response.status_code == 200, response.content
        return [e["document"]["key"] for e in response.json()["results"]]

    assert keys(users["product"]) == [KEY] and keys(users["analyst"]) == [KEY]
    assert keys(teams.olga) == [] and keys(teams.alan) == []
    assert keys(users["sre"]) == [KEY] and keys(users["admin"]) == [KEY]
    assert keys(users["admin"], "?team=search") == [KEY] and keys(users["admin"], "?team=ads") == []
    audit = _api(teams.olga).get("/api/audit/").json()["results"]
    assert audit == []
    assert [e["experiment_key"] for e in _api(users["analyst"]).get("/api/audit/").json()["results"]] == [KEY]


@pytest.mark.django_db
def test_a_deleted_drafts_audit_entries_stay_with_its_team(theirs, teams, users):
    assert _api(users["product"]).delete(f"/api/experiments/{KEY}/").status_code == 204
    assert AuditEntry.objects.filter(experiment_key=KEY, action="delete").exists()
    assert _api(teams.olga).get("/api/audit/").json()["results"] == []
    shown = _api(users["analyst"]).get("/api/audit/").json()["results"]
    assert [e["action"] for e in shown] == ["delete", "create"]


@pytest.mark.django_db
def test_a_product_user_creates_only_in_a_team_of_theirs(teams, document, users):
    olga = _api(teams.olga)
    for name in ("search", "no-such-team"):
        response = olga.post("/api/experiments/", {**document, "team": name}, format="json")
        assert response.status_code == 400, response.content
        message = response.json()["team"][0]
        assert "ads" in message  # the caller's own teams, never whether another team exists
    assert not Experiment.objects.exists()
    response = olga.post("/api/experiments/", document, format="json")  # her only team
    assert response.status_code == 201, response.content
    assert response.json()["document"]["team"] == "ads"
    assert Experiment.objects.get(key=KEY).team.name == "ads"
    teams.ads.members.add(users["product"])  # pat: search and ads
    response = _api(users["product"]).post("/api/experiments/", {**document, "key": "two"}, format="json")
    assert response.status_code == 400 and "several teams" in response.json()["team"][0]


@pytest.mark.django_db
def test_a_user_in_no_team_is_told_so(settings, teams, document):
    settings.DEFAULT_TEAM = ""  # no team to join: role users are put in teams by an administrator
    newcomer = _role_user("nia", "product")
    response = _api(newcomer).post("/api/experiments/", document, format="json")
    assert response.status_code == 400
    assert "no team" in response.json()["team"][0] and not Experiment.objects.exists()


@pytest.mark.django_db
def test_a_taken_key_of_another_team_is_refused_without_details(theirs, teams, document):
    response = _api(teams.olga).post("/api/experiments/", document, format="json")
    assert response.status_code == 400
    text = response.content.decode()
    assert "key" in response.json() and "search" not in text and "PUT" not in text
    _unchanged(theirs)


@pytest.mark.django_db
def test_sre_and_superusers_act_on_every_team(theirs, users):
    assert _api(users["sre"]).get(f"/api/experiments/{KEY}/").status_code == 200
    assert _api(users["sre"]).get(f"/api/experiments/{KEY}/weights").status_code == 200
    root = _api(users["admin"])
    response = root.patch(f"/api/experiments/{KEY}/", {"name": "renamed by root"}, format="json")
    assert response.status_code == 200, response.content
    assert root.post(f"/api/experiments/{KEY}/start/", {"reason": "go"}, format="json").status_code == 200
    theirs.refresh_from_db()
    assert (theirs.name, theirs.status, theirs.team.name) == ("renamed by root", "running", "search")


@pytest.mark.django_db
def test_replays_and_capacity_searches_follow_their_experiments_team(theirs, teams, users):
    run = ReplayRun.objects.create(experiment=theirs, source="x")
    search = CapacitySearch.objects.create(experiment=theirs)
    for outsider in (teams.olga, teams.alan):
        api = _api(outsider)
        assert api.get("/api/replays/").json()["results"] == []
        assert api.get(f"/api/replays/{run.pk}/").status_code == 404
        assert api.get("/api/capacity/").json()["results"] == []
        assert api.get(f"/api/capacity/{search.pk}/").status_code == 404
    reader = _api(users["analyst"])
    assert [r["id"] for r in reader.get("/api/replays/").json()["results"]] == [run.pk]
    assert reader.get(f"/api/capacity/{search.pk}/").status_code == 200
    # An SRE starting a replay names an experiment; another team's is "no experiment" to a
    # team-bound caller, exactly like a key that does not exist.
    response = _api(teams.olga).post("/api/replays/", {"experiment": KEY, "trace": "t"}, format="json")
    assert response.status_code == 403  # product users do not start replays at all


@pytest.mark.django_db
def test_dashboards_csv_rollout_and_capacity_pages_are_404_for_another_team(theirs, teams, users):
    pages = [
        f"/dashboards/{KEY}/",
        f"/dashboards/{KEY}/export/variants.csv",
        f"/rollouts/{KEY}/",
        f"/capacity/{KEY}/",
    ]
    for user in (teams.olga, teams.alan):
        for url in pages:
            assert _web(user).get(url).status_code == 404, (user.username, url)
    assert _web(users["analyst"]).get(f"/capacity/{KEY}/").status_code == 200
    assert _web(users["analyst"]).get(f"/rollouts/{KEY}/").status_code == 200


# --- documents and services ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_documents_path_refuses_another_teams_experiment(theirs, teams, document):
    for team in ("search", "ads", None):
        doc = {**document, "name": "hijacked"}
        if team:
            doc["team"] = team
        with pytest.raises(DocumentError) as info:
            services.apply_document(doc, actor=teams.olga)
        assert [e.path for e in info.value.errors] == ["key"]
        assert "search" not in str(info.value)
    with pytest.raises(DocumentError):
        services.check_document({**document, "name": "hijacked"}, actor=teams.olga)
    _unchanged(theirs)


@pytest.mark.django_db
def test_moving_an_experiment_needs_membership_of_the_team_it_goes_to(theirs, teams, users, document):
    pat = users["product"]
    with pytest.raises(DocumentError) as info:
        services.apply_document({**document, "team": "ads"}, actor=pat)
    assert [e.path for e in info.value.errors] == ["team"]
    teams.ads.members.add(pat)
    result = services.apply_document({**document, "team": "ads"}, actor=pat)
    assert result.changes == ["team: 'search' -> 'ads'"]
    assert AuditEntry.objects.filter(action="update").get().after["team"] == "ads"
    assert _api(teams.olga).get(f"/api/experiments/{KEY}/").status_code == 200


@pytest.mark.django_db
def test_services_refuse_lifecycle_moves_and_deletion_by_another_team(theirs, teams):
    with pytest.raises(PermissionDenied, match="team"):
        services.transition(theirs, "start", teams.olga)
    with pytest.raises(PermissionDenied, match="team"):
        services.delete_experiment(theirs, actor=teams.olga)
    _unchanged(theirs)
    assert not AuditEntry.objects.exclude(action="create").exists()


@pytest.mark.django_db
def test_the_document_names_its_team_and_applies_back_unchanged(theirs, users):
    exported = services.export_document(theirs)
    assert exported["team"] == "search"
    assert services.apply_document(exported, actor=users["product"]).changes == []
    without = {k: v for k, v in exported.items() if k != "team"}  # a document from before teams
    assert services.apply_document(without, actor=users["product"]).changes == []


@pytest.mark.parametrize("team", ["Search", "a b", "../x", "-x", 7, ["search"], "x" * 65])
def test_a_bad_team_name_is_refused_naming_the_field(document, team):
    from experiments.document import validate_document

    with pytest.raises(DocumentError) as info:
        validate_document({**document, "team": team})
    [error] = info.value.errors
    assert error.path == "team" and len(error.message) < 300


# --- the admin -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_shows_and_acts_on_the_users_teams_only(theirs, teams, users):
    olga = _web(teams.olga)
    listing = olga.get("/admin/experiments/experiment/").content.decode()
    assert KEY not in listing
    change = f"/admin/experiments/experiment/{theirs.pk}/change/"
    assert olga.get(change).status_code != 200
    olga.post(
        "/admin/experiments/experiment/", {"action": "start_experiments", "_selected_action": [theirs.pk]}
    )
    olga.post(f"/admin/experiments/experiment/{theirs.pk}/delete/", {"post": "yes"})
    _unchanged(theirs)
    assert KEY not in olga.get("/admin/experiments/auditentry/").content.decode()
    add = olga.get("/admin/experiments/experiment/add/").content.decode()
    assert f'<option value="{teams.ads.pk}"' in add and f'<option value="{teams.search.pk}"' not in add
    assert KEY in _web(users["product"]).get("/admin/experiments/experiment/").content.decode()
    assert KEY in _web(users["sre"]).get("/admin/experiments/experiment/").content.decode()
    # Teams are a superuser's to make and fill.
    assert olga.get("/admin/experiments/team/").status_code == 403
    teams_page = _web(users["admin"]).get("/admin/experiments/team/").content.decode()
    assert "search" in teams_page and "olga" in teams_page


@pytest.mark.django_db
def test_the_admin_refuses_a_team_the_user_is_not_in(teams, document):
    from tests.foundation.test_admin import form_data

    data = {**form_data(document), "team": teams.search.pk}
    response = _web(teams.olga).post("/admin/experiments/experiment/add/", data)
    assert response.status_code == 200 and "Select a valid choice" in response.content.decode()
    assert not Experiment.objects.exists()


# --- commands ------------------------------------------------------------------------------------


def _refused(*args) -> str:
    with pytest.raises(CommandError) as info:
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    return str(info.value)


@pytest.mark.django_db
def test_commands_act_as_a_user_of_the_experiments_team_only(theirs, teams, users, document, tmp_path):
    message = _refused("experiment", "start", KEY, "--as", "olga")
    assert "--as" in message and "olga" in message
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({**document, "name": "hijacked"}))
    assert "key" in _refused("apply_experiment", str(path), "--as", "olga")
    _unchanged(theirs)
    services.transition(theirs, "start", users["product"])
    message = _refused("set_weights", KEY, "fp16=50", "awq=25", "awq-fa2=25", "--reason", "x", "--as", "olga")
    assert "--as" in message
    theirs.refresh_from_db()
    assert theirs.weights() == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    call_command("experiment", "pause", KEY, "--as", "pat", stdout=io.StringIO())  # her own team's
    call_command("experiment", "resume", KEY, "--as", "sam", stdout=io.StringIO())  # sre: every team
    call_command("experiment", "pause", KEY, stdout=io.StringIO())  # the operator: every team


# --- joining and upgrading -----------------------------------------------------------------------


@pytest.mark.django_db
def test_role_users_join_the_default_team_unless_it_is_turned_off(settings, users):
    from experiments.models import Team

    newcomer = _role_user("nick", "product")
    reader = User.objects.create_user("rita")
    Group.objects.get(name="analyst").user_set.add(reader)  # from the group's side
    default = Team.objects.get(name=settings.DEFAULT_TEAM)
    assert {newcomer, reader} <= set(default.members.all())
    assert not users["sre"].abplat_teams.exists() and not users["nobody"].abplat_teams.exists()
    settings.DEFAULT_TEAM = ""
    assert not _role_user("nora", "product").abplat_teams.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_the_upgrade_puts_experiments_and_role_users_in_the_default_team_and_reverses():
    before, after = [("experiments", "0005_variant_cost")], [("experiments", "0008_team_required")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    Group = old.get_model("auth", "Group")
    OldUser = old.get_model("auth", "User")
    product = Group.objects.get_or_create(name="product")[0]
    sre = Group.objects.get_or_create(name="sre")[0]
    pat, sam = OldUser.objects.create(username="pat"), OldUser.objects.create(username="sam")
    pat.groups.add(product)
    sam.groups.add(sre)
    exp = old.get_model("experiments", "Experiment").objects.create(
        key="legacy", name="legacy", sla_ttft_ms=200, sla_target=0.9
    )
    old.get_model("experiments", "AuditEntry").objects.create(
        experiment=None, experiment_key="gone", actor_name="pat", action="delete"
    )
    executor = MigrationExecutor(connection)
    executor.migrate(after)
    new = executor.loader.project_state(after).apps
    team = new.get_model("experiments", "Team").objects.get()
    assert team.name == "default"
    assert [u.username for u in team.members.all()] == ["pat"]  # sre acts on every team anyway
    assert new.get_model("experiments", "Experiment").objects.get(pk=exp.pk).team_id == team.pk
    assert new.get_model("experiments", "AuditEntry").objects.get(experiment_key="gone").team_id == team.pk
    executor = MigrationExecutor(connection)
    executor.migrate(before)  # and back: nothing refuses
    assert old.get_model("experiments", "Experiment").objects.filter(key="legacy").exists()
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
