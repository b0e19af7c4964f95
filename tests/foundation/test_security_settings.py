"""Security settings: debug off by default, credentials never on an error page,
bounded API pages, request rates, expiring tokens, and a /healthz that tells strangers only
yes or no."""

from __future__ import annotations

import datetime as dt
import io
import sys
import threading

import pytest
from django.test import RequestFactory
from django.utils import timezone
from django.views import debug
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from abplat import health
from abplat.config import settings_from
from experiments.models import AuditEntry
from tests.foundation.test_settings import deploy_check, refusal

PASSWORD = "hunter2-do-not-show"
DEPLOY_KEY = "deploy-" + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP"


# ---- debug and secrets ------------------------------------------------------------------------
# Settings of a given environment, in this process (abplat.config.settings_from); that a refusal
# stops the process with that one line is tested once, in tests/foundation/test_settings.py.


def test_debug_is_off_unless_asked_for_and_then_a_key_is_required(tmp_path):
    # Required by what signs (the web processes refuse to start without it: test_secret_key.py),
    # and a weak one is refused everywhere, as any bad setting.
    assert settings_from({"ABPLAT_VAR": str(tmp_path)})["SECRET_KEY"] == ""
    assert refusal({"ABPLAT_VAR": str(tmp_path), "ABPLAT_SECRET_KEY": "short"}).startswith(
        "ABPLAT_SECRET_KEY is too weak"
    )
    assert settings_from({"ABPLAT_VAR": str(tmp_path), "ABPLAT_DEBUG": "true"})["DEBUG"] is True
    assert settings_from({"ABPLAT_VAR": str(tmp_path), "ABPLAT_SECRET_KEY": DEPLOY_KEY})["DEBUG"] is False


def test_deploy_checks_pass_with_only_a_secret_key_set(tmp_path):
    output = deploy_check({"ABPLAT_VAR": str(tmp_path), "ABPLAT_SECRET_KEY": DEPLOY_KEY})
    assert "no issues" in output, output


def test_a_bad_throttle_rate_stops_start_naming_the_variable(tmp_path):
    environ = {"ABPLAT_VAR": str(tmp_path), "ABPLAT_DEBUG": "true", "ABPLAT_API_THROTTLE_USER": "lots"}
    assert "ABPLAT_API_THROTTLE_USER='lots'" in refusal(environ)


def _technical_500(settings, **meta) -> str:
    settings.DEBUG = True
    debug.get_default_exception_reporter_filter.cache_clear()
    request = RequestFactory().get("/boom", **meta)
    dsn = f"clickhouse://default:{PASSWORD}@ch.internal:9000/abplat"  # noqa: F841 - shown per frame
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        return debug.technical_500_response(request, *sys.exc_info()).content.decode()


def test_the_debug_page_shows_no_password_whatever_the_setting_is_called(settings):
    settings.ABPLAT_DATABASE_URL = f"postgres://abplat:{PASSWORD}@db.internal/abplat"
    settings.ANALYTICS_STORE = f"clickhouse://default:{PASSWORD}@ch.internal:9000/abplat"  # innocent name
    settings.REPLICAS = {"primary": {"HOST": "db", "LOCATION": f"redis://:{PASSWORD}@cache:6379/0"}}
    settings.CELERY_BROKER_URL = f"amqp://abplat:{PASSWORD}@mq.internal//"
    page = _technical_500(
        settings,
        ABPLAT_CLICKHOUSE_URL=f"clickhouse://u:{PASSWORD}@h/db",
        HTTP_X_MIRROR=f"https://u:{PASSWORD}@mirror.internal/",
    )
    assert "boom" in page and "ch.internal" in page  # the page is there, and shows the hosts
    assert PASSWORD not in page


def test_the_reporter_filter_strips_url_credentials_and_keeps_the_rest(settings):
    from abplat.api import RedactingExceptionReporterFilter

    f = RedactingExceptionReporterFilter()
    assert f.cleanse_setting("MIRRORS", [f"https://bob:{PASSWORD}@h.example/x", "https://h/y"]) == [
        "https://***@h.example/x",
        "https://h/y",
    ]
    for name in ("SENTRY_DSN", "ETCD_CA_CERT", "ETCD_ENDPOINTS", "STORE_URL", "GITHUB_CREDENTIALS"):
        assert f.cleanse_setting(name, "value") == f.cleansed_substitute, name
    assert f.cleanse_setting("TIME_ZONE", "UTC") == "UTC"
    assert f.is_active(None)  # with DEBUG on too


# ---- pages, rates -----------------------------------------------------------------------------


@pytest.fixture
def audit_rows(experiment):
    AuditEntry.objects.bulk_create(
        AuditEntry(experiment=experiment, experiment_key=experiment.key, actor_name="pat", action="note")
        for _ in range(30)
    )


@pytest.mark.django_db
def test_a_page_larger_than_the_maximum_is_a_400_naming_it(client_for, audit_rows, settings):
    settings.API_MAX_PAGE_SIZE = 25
    client = client_for("analyst")
    response = client.get("/api/audit/?limit=100000000")
    assert response.status_code == 400 and response.json() == {
        "limit": ["limit must be <= 25 (API_MAX_PAGE_SIZE); page with offset"]
    }
    for bad in ("0", "-1", "ten", "²", "1.5"):
        answer = client.get(f"/api/audit/?limit={bad}")
        assert answer.status_code == 400 and "limit" in answer.json(), bad
    assert client.get("/api/audit/?offset=²").status_code == 400
    body = client.get("/api/audit/?limit=25").json()
    assert len(body["results"]) == 25 and body["count"] == 31  # 30 notes + the creation
    assert len(client.get("/api/audit/").json()["results"]) == 25  # default page fits under the cap


@pytest.mark.django_db
def test_the_audit_list_takes_a_fixed_number_of_queries(
    client_for, audit_rows, django_assert_max_num_queries
):
    client = client_for("analyst")
    with django_assert_max_num_queries(5):  # permissions (2), count, page, session
        assert client.get("/api/audit/?limit=30").status_code == 200


@pytest.mark.django_db
def test_the_experiment_list_takes_a_fixed_number_of_queries(
    client_for, document, users, django_assert_max_num_queries
):
    from experiments import services

    for i in range(12):
        services.apply_document({**document, "key": f"exp-{i}"}, actor=users["product"])
    with django_assert_max_num_queries(6):  # permissions (2), count, page, variants, session
        response = client_for("analyst").get("/api/experiments/")
    assert response.status_code == 200 and response.json()["count"] == 12


@pytest.mark.django_db
def test_the_replay_list_takes_a_fixed_number_of_queries(
    client_for, experiment, users, django_assert_max_num_queries
):
    from workers.models import ReplayRun, ReplayShard

    for _ in range(12):
        run = ReplayRun.objects.create(experiment=experiment, source="t.csv", started_by=users["sre"])
        ReplayShard.objects.bulk_create(ReplayShard(run=run, index=i) for i in range(2))
    with django_assert_max_num_queries(6):  # permissions (2), count, page, shards, session
        response = client_for("sre").get("/api/replays/")
    assert response.status_code == 200 and response.json()["count"] == 12


@pytest.mark.django_db
def test_api_requests_over_the_user_rate_get_429(client_for, experiment, settings):
    settings.API_THROTTLE_USER = "3/min"
    analyst, sre = client_for("analyst"), client_for("sre")
    codes = [analyst.get("/api/experiments/").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    assert int(analyst.get("/api/experiments/")["Retry-After"]) <= 60
    assert sre.get("/api/experiments/").status_code == 200  # per user


@pytest.mark.django_db
def test_the_assign_endpoint_has_its_own_rate(client_for, experiment, settings):
    from experiments import services

    services.transition(experiment, "start", None)
    settings.API_THROTTLE_USER, settings.API_THROTTLE_ASSIGN = "2/min", "5/min"
    client = client_for("analyst")
    codes = [
        client.get(f"/api/experiments/{experiment.key}/assign?user_id=u{i}").status_code for i in range(6)
    ]
    assert codes == [200] * 5 + [429]
    # the assign rate replaced the user rate there; elsewhere the user rate still counts
    assert [client.get("/api/experiments/").status_code for _ in range(3)] == [200, 200, 429]


@pytest.mark.django_db
def test_admin_sign_in_attempts_are_limited_per_address(client, users, settings):
    settings.API_THROTTLE_LOGIN = "3/min"
    attempts = [
        client.post("/admin/login/", {"username": "root", "password": "wrong"}, REMOTE_ADDR="10.0.0.7")
        for _ in range(4)
    ]
    assert [r.status_code for r in attempts] == [200, 200, 200, 429]
    assert "Too many sign-in attempts" in attempts[-1].content.decode() and attempts[-1]["Retry-After"]
    assert client.get("/admin/login/", REMOTE_ADDR="10.0.0.7").status_code == 200  # the form itself
    # even the right password waits now; another address does not
    right = {"username": "root", "password": "pw-root"}
    assert client.post("/admin/login/", right, REMOTE_ADDR="10.0.0.7").status_code == 429
    assert client.post("/admin/login/", right, REMOTE_ADDR="10.0.0.8").status_code == 302


# ---- tokens, /healthz -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.engine
def test_a_token_older_than_its_lifetime_is_a_401_token_expired(users, settings):
    settings.API_TOKEN_TTL_S = 3600
    token = Token.objects.create(user=users["analyst"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/experiments/").status_code == 200
    Token.objects.filter(pk=token.pk).update(created=timezone.now() - dt.timedelta(seconds=3601))
    response = client.get("/api/experiments/")
    assert response.status_code == 401 and "token expired" in response.json()["detail"]
    assert response["WWW-Authenticate"] == "Token"


@pytest.fixture
def failing_service(monkeypatch):
    def broken() -> str:
        raise ConnectionError(f"connect to db.internal:5432 as abplat:{PASSWORD} refused")

    monkeypatch.setitem(health.CHECKS, "database", broken)


@pytest.mark.django_db
def test_anonymous_healthz_says_only_ok_or_not(client, failing_service):
    response = client.get("/healthz")
    assert response.status_code == 503 and response.json() == {"ok": False}
    assert b"db.internal" not in response.content and PASSWORD.encode() not in response.content


@pytest.mark.django_db
def test_staff_get_each_service_and_its_error(client, users, failing_service):
    client.force_login(users["sre"])  # staff
    body = client.get("/healthz").json()
    assert body["ok"] is False and "ConnectionError" in body["services"]["database"]["status"]
    assert body["services"]["broker"]["ok"] is True
    client.force_login(users["nobody"])  # signed in, not staff
    assert client.get("/healthz").json() == {"ok": False}


def test_healthz_runs_the_checks_at_once_and_does_not_wait_for_a_hung_one(monkeypatch):
    together = threading.Barrier(3, timeout=10)  # breaks unless three checks run at the same time
    release = threading.Event()

    def meets_the_others() -> str:
        together.wait()
        return "ok"

    def hung() -> str:
        release.wait(30)
        return "ok"

    monkeypatch.setattr(health, "CHECK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(
        health, "CHECKS", {"a": meets_the_others, "b": meets_the_others, "c": meets_the_others, "d": hung}
    )
    try:
        healthy, report = health.run_checks()  # waiting for "d" would make it "ok" after 30 s
    finally:
        release.set()
    assert not healthy
    assert report["d"] == {"ok": False, "status": "error: no answer within 0.5 s", "ms": 500.0}
    assert all(report[k]["ok"] for k in "abc"), report


@pytest.mark.django_db
def test_demo_makes_its_superuser_only_on_the_embedded_database(settings):
    from django.contrib.auth.models import User

    from workers.management.commands.demo import Command

    settings.DATABASE_URL = "postgres://abplat@db.internal/abplat"  # as ABPLAT_DATABASE_URL sets it
    out = io.StringIO()
    assert Command(stdout=out).demo_user(create=False) is None
    assert not User.objects.filter(username="demo").exists()
    assert "not creating the demo/demo superuser" in out.getvalue() and "--create-demo-user" in out.getvalue()
    assert Command(stdout=io.StringIO()).demo_user(create=True).is_superuser
    User.objects.filter(username="demo").delete()
    settings.DATABASE_URL = ""  # the embedded SQLite default
    assert Command(stdout=io.StringIO()).demo_user(create=False).check_password("demo")
