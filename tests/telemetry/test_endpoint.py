"""/metrics in the web: who may read it (networks, bearer token), what it shows (this process's
metrics in the embedded mode, runs by status from the database), and the request metrics of
every other view, labelled by view name and never by path."""

from __future__ import annotations

import pytest

from tests.telemetry.conftest import parse, total
from workers.models import ReplayRun

TOKEN = "s3cret-token-for-prometheus-0123456789"


@pytest.fixture
def web(client):
    client.defaults["HTTP_HOST"] = "127.0.0.1"
    return client


def get(web, address="127.0.0.1", **headers):
    return web.get("/metrics", REMOTE_ADDR=address, **headers)


@pytest.mark.django_db
def test_loopback_reads_metrics_in_the_prometheus_text_format(web):
    web.get("/healthz", REMOTE_ADDR="10.9.9.9")
    response = get(web)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")  # the exposition format
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    series = parse(response.content.decode())
    assert total(series, "abplat_http_requests_total", view="healthz", method="GET", status="2xx") >= 1
    assert get(web, "::1").status_code == 200  # IPv6 loopback too


@pytest.mark.django_db
@pytest.mark.parametrize("address", ["10.0.0.7", "192.168.1.2", "2001:db8::1", "not-an-address", ""])
def test_other_addresses_are_refused_and_see_no_metric(web, address):
    response = get(web, address, HTTP_X_FORWARDED_FOR="127.0.0.1")  # a forwarded header is not trusted
    assert response.status_code == 403
    assert b"abplat_" not in response.content
    assert b"ABPLAT_METRICS_ALLOWED_CIDRS" in response.content


@pytest.mark.django_db
def test_a_bearer_token_opens_it_from_anywhere_and_a_wrong_one_does_not(web, settings):
    settings.METRICS_TOKEN = TOKEN
    settings.METRICS_NETWORKS = ()  # ABPLAT_METRICS_ALLOWED_CIDRS=none: the token only
    assert get(web, "10.0.0.7", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert get(web, "10.0.0.7", HTTP_AUTHORIZATION=f"bearer {TOKEN}").status_code == 200
    assert get(web, "10.0.0.7", HTTP_AUTHORIZATION=f"Bearer {TOKEN[:-1]}").status_code == 403
    assert get(web, "10.0.0.7", HTTP_AUTHORIZATION=f"Basic {TOKEN}").status_code == 403
    assert get(web, "10.0.0.7").status_code == 403
    assert get(web, "127.0.0.1").status_code == 403  # no network listed: loopback too needs it


@pytest.mark.django_db
def test_listed_networks_and_ipv4_mapped_addresses_are_allowed(web, settings):
    from telemetry.metrics import parse_networks

    settings.METRICS_NETWORKS = parse_networks(["10.0.0.0/8", "192.168.1.5"], "X")
    assert get(web, "10.200.0.1").status_code == 200
    assert get(web, "::ffff:10.1.2.3").status_code == 200
    assert get(web, "192.168.1.5").status_code == 200
    assert get(web, "192.168.1.6").status_code == 403
    assert get(web, "127.0.0.1").status_code == 403


@pytest.mark.django_db
def test_only_get_and_head(web):
    assert web.post("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 405
    assert web.head("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200


@pytest.mark.django_db
def test_metrics_is_not_redirected_to_https_when_everything_else_is(web, settings):
    settings.SECURE_SSL_REDIRECT = True
    assert web.get("/healthz", REMOTE_ADDR="127.0.0.1").status_code == 301
    assert get(web).status_code == 200


@pytest.mark.django_db
@pytest.mark.engine
def test_runs_by_status_are_read_from_the_database(web, experiment):
    for status in ("running", "running", "done", "failed"):
        ReplayRun.objects.create(
            experiment=experiment, source="t.csv", status=status, total_requests=1, expected_samples=1
        )
    series = parse(get(web).content.decode())
    assert total(series, "abplat_replay_runs", status="running") == 2
    assert total(series, "abplat_replay_runs", status="done") == 1
    assert total(series, "abplat_replay_runs", status="failed") == 1
    assert total(series, "abplat_replay_runs", status="queued") == 0  # every status, zeros too


@pytest.mark.django_db
def test_requests_are_labelled_by_view_name_never_by_path_or_key(web, users, experiment):
    web.force_login(users["analyst"])
    before = parse(get(web).content.decode())
    web.get(f"/api/experiments/{experiment.key}/", REMOTE_ADDR="10.0.0.1")
    web.get("/api/experiments/no-such-experiment-key/", REMOTE_ADDR="10.0.0.1")
    web.get("/no/such/path/ab12", REMOTE_ADDR="10.0.0.1")
    text = get(web).content.decode()
    after = parse(text)
    # The HTTP request series: other metrics carry an experiment label by design (the replays'
    # and the gateway's, docs/metrics.md), and other tests in this process may have set them.
    http = [line for line in text.splitlines() if line.startswith("abplat_http_")]
    assert http
    for secretish in (experiment.key, "no-such-experiment-key", "ab12", "/api/"):
        assert not [line for line in http if secretish in line]
    views = {dict(ls)["view"] for n, ls in after if n == "abplat_http_requests_total"}
    assert "unmatched" in views
    detail = [v for v in views if "experiment" in v and "detail" in v]
    assert detail, views

    def delta(**labels):
        return total(after, "abplat_http_requests_total", **labels) - total(
            before, "abplat_http_requests_total", **labels
        )

    assert delta(view=detail[0], status="2xx") == 1
    assert delta(view=detail[0], status="4xx") == 1
    assert delta(view="unmatched", status="4xx") == 1
    assert total(after, "abplat_http_request_duration_seconds_count", view=detail[0]) >= 2


@pytest.mark.django_db
def test_through_a_trusted_proxy_on_loopback_the_client_address_decides(web, settings):
    """nginx on the same host (ABPLAT_TRUSTED_PROXIES=127.0.0.1): a request it forwards comes
    from loopback, but the client named in X-Forwarded-For is the one checked."""
    from abplat.proxy import parse_proxies

    settings.TRUSTED_PROXY_NETWORKS = parse_proxies(["127.0.0.1"])
    assert get(web, "127.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.9").status_code == 403
    assert get(web, "127.0.0.1", HTTP_X_FORWARDED_FOR="127.0.0.1").status_code == 200
    assert get(web, "127.0.0.1").status_code == 200  # not forwarded: the peer itself
