# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""Dashboard page, CSV export, report API and sla_report command over real samples."""

from __future__ import annotations

import csv
import io
import json

import pytest
from django.core.management import call_command

from samples.factory import _cache as store_cache
from tests.analysis.fixtures_report import loaded_stores, mirror_data, server_url_for, split_data  # noqa: F401

pytestmark = pytest.mark.django_db

ROLES_ALLOWED = ["analyst", "product", "sre", "admin"]


@pytest.fixture
def samples_db(settings, loaded_stores):
    """Point the app's sample store at the server database holding the synthetic samples."""
    settings.CLICKHOUSE_URL = server_url_for(loaded_stores["server"].database)
    yield
    store_cache.clear()


def _login(client, users, role):
    client.force_login(users[role])
    return client


@pytest.mark.parametrize("role", ROLES_ALLOWED)
def test_dashboard_page_renders_for_viewer_roles(client, users, experiment, samples_db, role):
    resp = _login(client, users, role).get("/dashboards/ttft-opt/")
    assert resp.status_code == 200
    html = resp.content.decode()
    for chart in ("attainment", "cdf", "percentiles", "p99-time", "attribution", "phases", "srm"):
        assert f'id="chart-{chart}"' in html
    assert "/dashboards/assets/plotly-" in html
    assert "for 99.2% of requests" in html  # the target as set, not rounded
    assert len(resp.content) < 1_000_000


def test_dashboard_forbids_users_without_view_permission(client, users, experiment, samples_db):
    assert _login(client, users, "nobody").get("/dashboards/ttft-opt/").status_code == 403
    assert client.get("/dashboards/ttft-opt/export/variants.csv").status_code == 403


def test_anonymous_is_sent_to_the_admin_login(client, experiment):
    resp = client.get("/dashboards/ttft-opt/")
    assert resp.status_code == 302
    assert resp["Location"].startswith("/admin/login/?next=/dashboards/ttft-opt/")


def test_unknown_experiment_is_404_and_bad_filters_are_400(client, users, experiment, samples_db):
    _login(client, users, "analyst")
    assert client.get("/dashboards/nope/").status_code == 404
    resp = client.get("/dashboards/ttft-opt/?run=abc")
    assert resp.status_code == 400 and b"run='abc'" in resp.content
    resp = client.get("/dashboards/ttft-opt/?variant=zzz")
    assert resp.status_code == 400 and b"zzz" in resp.content
    resp = client.get("/dashboards/ttft-opt/?since=yesterday")
    assert resp.status_code == 400 and b"since=" in resp.content


def test_csv_export_matches_the_report(client, users, experiment, samples_db, split_data):
    _login(client, users, "analyst")
    resp = client.get("/dashboards/ttft-opt/export/variants.csv?run=11")
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(resp.content.decode())))
    latest = split_data.latest()
    assert {r["variant"]: int(r["n"]) for r in rows} == {
        v: int((latest["variant"] == v).sum()) for v in ("fp16", "awq", "awq-fa2")
    }
    for table in ("percentiles", "comparisons", "segments", "phases", "attribution", "srm"):
        resp = client.get(f"/dashboards/ttft-opt/export/{table}.csv")
        assert resp.status_code == 200 and len(resp.content.splitlines()) > 2, table
    assert client.get("/dashboards/ttft-opt/export/secrets.csv").status_code == 400


@pytest.mark.parametrize(
    "role, status",
    [("analyst", 200), ("product", 200), ("sre", 200), ("admin", 200), ("nobody", 403), (None, 401)],
)
def test_report_api_permissions(client_for, experiment, samples_db, role, status):
    resp = client_for(role).get("/api/experiments/ttft-opt/report")
    assert resp.status_code == status


def test_report_api_returns_the_command_json(client_for, experiment, samples_db):
    api = client_for("analyst").get("/api/experiments/ttft-opt/report?run=11&variant=awq").json()
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--run", "11", "--variant", "awq", "--json", stdout=out)
    cmd = json.loads(out.getvalue())
    for doc in (api, cmd):
        doc.pop("generated_at"), doc.pop("timing")
    assert api == cmd
    assert api["schema_version"] == 2  # 2: itl_ms over every gap
    assert [v["key"] for v in api["variants"]] == ["fp16", "awq"]
    bad = client_for("analyst").get("/api/experiments/ttft-opt/report?run=-1")
    assert bad.status_code == 400 and "run" in bad.json()["filters"]


def test_sla_report_command_prints_a_table_and_writes_csv(experiment, samples_db, tmp_path):
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    assert "attainment [95% CI]" in text and "awq-fa2" in text and "Why awq-fa2" in text
    assert (tmp_path / "variants.csv").read_text().startswith("variant,control,n,")
    with pytest.raises(Exception, match="no experiment with key 'nope'"):
        call_command("sla_report", "nope")


@pytest.mark.engine
def test_the_page_shows_the_anytime_intervals_labelled_beside_the_fixed_horizon_ones(
    client, users, experiment, samples_db
):
    from dashboards.tables import interval_text
    from experiments.models import Experiment

    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-opt/report").json()
    html = client.get("/dashboards/ttft-opt/").content.decode()
    assert "Anytime-valid intervals (may be read mid-run)" in html and "<b>fixed-horizon</b>" in html
    table = html[
        html.index('id="anytime-intervals"') : html.index("</table>", html.index('id="anytime-intervals"'))
    ]
    for v, e in report["anytime"]["variants"].items():
        row = table[table.index(f"<td>{v}</td>") :].split("</tr>")[0]
        assert interval_text(e["attainment"], ".4f") in row
        assert interval_text(e["p99_ttft_ms"], ".1f") in row
        if e["vs_control"]:
            assert interval_text(e["vs_control"]["attainment_difference"], "+.4f") in row
    assert "Split (sequential SRM test): anytime p=" in html
    assert "rollout timeline" not in html  # no rollout plan: no link
    Experiment.objects.filter(key="ttft-opt").update(rollout={"candidate": "awq-fa2"})
    html = client.get("/dashboards/ttft-opt/").content.decode()
    assert 'href="/rollouts/ttft-opt/">rollout timeline</a>' in html


def test_sla_report_prints_the_anytime_block_and_writes_its_csv(experiment, samples_db, tmp_path):
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    assert "Anytime-valid intervals (alpha 0.05;" in text and "read them when the run is over" in text
    assert "split (sequential SRM): anytime p=" in text
    rows = list(csv.DictReader(io.StringIO((tmp_path / "anytime.csv").read_text())))
    # 3 sequences per variant, 3 differences per non-control variant
    assert len(rows) == 3 * 3 + 2 * 3
    assert {r["quantity"] for r in rows} >= {"attainment", "p99_ttft_difference", "error_rate_difference"}
    for r in rows:
        if r["quantity"] == "attainment":
            assert float(r["lo"]) < float(r["estimate"]) < float(r["hi"])


def test_plotly_js_is_served_once_with_a_long_lived_cache(client, users, samples_db):
    from dashboards.views import plotly_url

    url = plotly_url()
    resp = client.get(url, HTTP_ACCEPT_ENCODING="gzip")
    assert resp.status_code == 200
    assert resp["Content-Encoding"] == "gzip"
    assert "immutable" in resp["Cache-Control"]
    assert client.get(url.replace("plotly-", "plotly-0.0.")).status_code == 404


def test_the_page_labels_itl_as_every_gap_and_says_what_its_ci_assumes(client, users, experiment, samples_db):
    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-opt/report").json()
    html = client.get("/dashboards/ttft-opt/").content.decode()
    table = json.loads(html[html.index('id="percentiles"') :].split(">", 1)[1].split("</script>", 1)[0])
    labels = table["data"][0]["cells"]["values"][1]
    assert "ITL (all gaps)" in labels and "TPOT" in labels and "ITL (per-request mean)" not in labels
    note = html[html.index('id="itl-note"') :].split("</div>", 1)[0]
    assert "independent draws, which they are not within one request" in note
    for v in report["variants"]:
        assert f"<b>{v['key']}</b> {v['itl']['gaps']} gaps from {v['itl']['requests']} requests" in note


def test_the_page_shows_per_user_and_adjusted_differences_beside_the_unadjusted(
    client, users, experiment, samples_db
):
    from dashboards.tables import interval_text, percent_text

    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-opt/report").json()
    html = client.get("/dashboards/ttft-opt/").content.decode()
    assert "Per user: the unit of randomization" in html and "are not adjusted" in html
    means = html[html.index('id="per-user-means"') :].split("</table>", 1)[0]
    diffs = html[html.index('id="adjusted-differences"') :].split("</table>", 1)[0]
    for e in report["variants"]:
        row = means[means.index(f"<td>{e['key']}</td>") :].split("</tr>", 1)[0]
        assert interval_text(e["clustered"]["attainment"], ".4f") in row
        assert interval_text(e["clustered"]["mean_ttft_ms"], ".1f") in row
        if e["vs_control"]:
            plain = e["vs_control"]["clustered"]["mean_ttft_difference"]
            adj = e["vs_control"]["adjusted"]["mean_ttft_difference"]
            row = [r for r in diffs.split("</tr>") if f"<td>{e['key']}</td>" in r and "mean TTFT ms" in r][0]
            assert interval_text(plain, "+.1f") in row and interval_text(adj, "+.1f") in row
            assert f"<td>{percent_text(adj['adjusted']['variance_reduction'])}</td>" in row
            assert "prompt_tokens" in row  # max_tokens is constant in these samples: left out, named
            assert adj["adjusted"]["not_used"] == {"max_tokens": "constant over these requests (256)"}


def test_sla_report_prints_unadjusted_and_adjusted_side_by_side_and_the_switch_off(
    experiment, samples_db, tmp_path
):
    from dashboards import tables
    from experiments.models import Experiment

    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    assert "Per user, the unit of randomization (clustered: users are the independent unit" in text
    assert "unadjusted [95% CI]" in text and "adjusted [95% CI]" in text and "(on prompt_tokens)" in text
    assert "p99 TTFT and the other percentiles are not adjusted" in text
    rows = list(csv.DictReader(io.StringIO((tmp_path / "clustered.csv").read_text())))
    quantities = {r["quantity"] for r in rows}
    assert {
        "attainment",
        "mean_ttft_ms",
        "mean_ttft_difference",
        "mean_ttft_difference_adjusted",
    } <= quantities
    adjusted = [r for r in rows if r["quantity"].endswith("_adjusted")]
    assert adjusted and all(r["adjusted_on"] == "prompt_tokens" and r["variance_reduction"] for r in adjusted)
    assert {r["inference"] for r in rows} == {"user-clustered"}

    Experiment.objects.filter(key="ttft-opt").update(analysis_cluster_by_user=False, analysis_adjust=False)
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    assert "off for this experiment (analysis: cluster_by_user false, adjust false)" in text
    assert "adjusted [95% CI]" not in text
    header = ",".join(tables.COLUMNS["clustered"])
    assert (tmp_path / "clustered.csv").read_text().splitlines() == [header]  # the header alone
