# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""Dashboard page, CSV export, report API and sla_report command over real samples."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from django.core.management import call_command

from samples import synthetic
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
    for chart in ("attainment", "cdf", "p99-time", "attribution-awq", "attribution-awq-fa2", "phases", "srm"):
        assert f'id="chart-{chart}"' in html
    assert 'id="percentiles"' in html
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
    assert api["schema_version"] == 3  # 3: setup errors apart (docs/report-json.md)
    assert [v["key"] for v in api["variants"]] == ["fp16", "awq"]
    bad = client_for("analyst").get("/api/experiments/ttft-opt/report?run=-1")
    assert bad.status_code == 400 and "run" in bad.json()["filters"]


def test_sla_report_command_prints_a_table_and_writes_csv(experiment, samples_db, tmp_path):
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    assert "attainment [95% CI]" in text and "awq-fa2" in text and "Why awq-fa2" in text
    assert (tmp_path / "variants.csv").read_text().startswith("variant,control,n,")
    with pytest.raises(Exception, match="no experiment 'nope'"):
        call_command("sla_report", "nope")


@pytest.mark.engine
def test_the_page_shows_the_anytime_intervals_labelled_beside_the_fixed_horizon_ones(
    client, users, experiment, samples_db
):
    from dashboards.summaries import interval_text
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
    requests = [r for r in rows if r["inference"] == "requests" and not r["quantity"].endswith("_adjusted")]
    # 3 sequences per variant, 3 differences per non-control variant
    assert len(requests) == 3 * 3 + 2 * 3
    assert {r["quantity"] for r in requests} >= {"attainment", "p99_ttft_difference", "error_rate_difference"}
    for r in requests:
        if r["quantity"] == "attainment":
            assert float(r["lo"]) < float(r["estimate"]) < float(r["hi"])
    # beside them (the experiment clusters by user and adjusts, the default): per variant its 3
    # user-clustered sequences, per non-control variant 3 clustered and 3 adjusted differences
    assert len(rows) == len(requests) + 3 * 3 + 2 * 3 + 2 * 3
    assert {r["inference"] for r in rows} == {"requests", "user-clustered"}


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
    table = html[html.index('id="percentiles"') :].split("</table>", 1)[0]
    labels = [re.findall(r"<td>(.*?)</td>", tr)[1] for tr in table.split("<tr>")[2:]]
    assert "ITL (all gaps)" in labels and "TPOT" in labels and "ITL (per-request mean)" not in labels
    note = html[html.index('id="itl-note"') :].split("</div>", 1)[0]
    assert "independent draws, which they are not within one request" in note
    for v in report["variants"]:
        assert f"<b>{v['key']}</b> {v['itl']['gaps']} gaps from {v['itl']['requests']} requests" in note


def test_the_page_shows_per_user_and_adjusted_differences_beside_the_unadjusted(
    client, users, experiment, samples_db
):
    from dashboards.summaries import interval_text, percent_text

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


# ---- the anytime-valid user-clustered and adjusted sequences beside the request-level ones -----

USERS_RUN, FEW_RUN = 41, 42


def users_spec() -> synthetic.SyntheticSpec:
    """Users who send many correlated requests (heavy-tailed), a tenth of the requests without a
    user, requested output tokens that vary: enough users per arm for every sequence's bounds."""
    return synthetic.SyntheticSpec(
        experiment="ttft-users",
        n=8_000,
        seed=21,
        run_id=USERS_RUN,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=1200.0,
        users=400,
        user_sigma=0.6,
        no_user_share=0.1,
        max_tokens=(128, 256, 512, 1024),
    )


def few_spec() -> synthetic.SyntheticSpec:
    """30 users in all: fewer than the unit sequences' minimum per arm, so they have no bounds."""
    return synthetic.SyntheticSpec(
        experiment="ttft-few",
        n=600,
        seed=22,
        run_id=FEW_RUN,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=600.0,
        users=30,
        user_sigma=0.6,
        max_tokens=(128, 256, 512, 1024),
    )


@pytest.fixture(scope="module")
def users_columns() -> dict[str, dict]:
    return {spec.experiment: synthetic.generate(spec).columns for spec in (users_spec(), few_spec())}


@pytest.fixture
def users_db(settings, shared_store, users_columns, document, users):
    """The app's store pointed at the session's server database holding the two users datasets,
    each its own experiment (the demo document under another key)."""
    from experiments.services import apply_document

    store = shared_store("server")
    for columns in users_columns.values():
        store.insert_columns(columns)
    settings.CLICKHOUSE_URL = server_url_for(store.database)
    store_cache.clear()
    for key in users_columns:
        apply_document({**document, "key": key}, actor=users["product"])
    yield
    store_cache.clear()


def anytime_table(html: str) -> list[dict]:
    """The page's anytime table: per row its data-inference kind and its cells, notes under the
    row they follow."""
    table = html[html.index('id="anytime-intervals"') :].split("</table>", 1)[0]
    rows: list[dict] = []
    for tr in table.split("<tr")[2:]:  # the table's attributes, then the header row
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        if 'class="anytime-note"' in tr:
            rows[-1]["notes"].append(cells[1])
            continue
        kind = re.search(r'data-inference="([^"]*)"', tr).group(1)
        rows.append({"kind": kind, "variant": cells[0], "cells": cells, "notes": []})
    return rows


def by_kind(rows: list[dict], variant: str) -> dict[str, dict]:
    return {r["kind"]: r for r in rows if r["variant"] == variant}


@pytest.mark.services  # users_db: the session's ClickHouse server database
def test_the_anytime_table_shows_the_user_clustered_and_adjusted_sequences_of_the_report(
    client, users, users_db, tmp_path
):
    from dashboards.summaries import interval_text, sequence_text

    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-users/report").json()
    assert report["anytime"]["units"]["unit"] == "user"
    rows = anytime_table(client.get("/dashboards/ttft-users/").content.decode())
    assert [r["kind"] for r in rows] == [
        "requests",
        "clustered",  # the control: no differences, so none adjusted
        "requests",
        "clustered",
        "adjusted",
        "requests",
        "clustered",
        "adjusted",
    ]
    for v, e in report["anytime"]["variants"].items():
        got = by_kind(rows, v)
        # the request-level row as before: p99 TTFT, no mean TTFT
        assert got["requests"]["cells"][1:6] == [
            "requests",
            interval_text(e["attainment"], ".4f"),
            interval_text(e["error_rate"], ".4f"),
            interval_text(e["p99_ttft_ms"], ".1f"),
            "",
        ]
        per = e["clustered"]
        assert per["inference"] == "user-clustered" and per["attainment"]["lo"] is not None
        # user-clustered: mean TTFT, no p99 (per request only)
        assert got["clustered"]["cells"][1:6] == [
            "user-clustered",
            sequence_text(per["attainment"], ".4f"),
            sequence_text(per["error_rate"], ".4f"),
            "",
            sequence_text(per["mean_ttft_ms"], ".1f"),
        ]
        assert got["clustered"]["notes"] == [] and "—" not in "".join(got["clustered"]["cells"])
        vs = e["vs_control"]
        if vs is None:
            assert got["clustered"]["cells"][6:10] == ["-", "-", "", "-"] and "adjusted" not in got
            continue
        cd, ad = vs["clustered"], vs["adjusted"]
        assert got["clustered"]["cells"][6:10] == [
            sequence_text(cd["attainment_difference"], "+.4f"),
            sequence_text(cd["error_rate_difference"], "+.4f"),
            "",
            sequence_text(cd["mean_ttft_difference"], "+.1f"),
        ]
        assert ad["inference"] == "user-clustered"
        assert ad["mean_ttft_difference"]["adjusted"]["covariates"] == ["prompt_tokens", "max_tokens"]
        assert got["adjusted"]["cells"][1:] == [
            "user-clustered, adjusted",
            "",
            "",
            "",
            "",
            sequence_text(ad["attainment_difference"], "+.4f"),
            sequence_text(ad["error_rate_difference"], "+.4f"),
            "",
            sequence_text(ad["mean_ttft_difference"], "+.1f"),
            "prompt_tokens, max_tokens",
        ]
        # the request-level differences are where they were, p99 among them
        assert got["requests"]["cells"][6:9] == [
            interval_text(vs["attainment_difference"], "+.4f"),
            interval_text(vs["error_rate_difference"], "+.4f"),
            interval_text(vs["p99_ttft_difference"], "+.1f"),
        ]

    # the same numbers in anytime.csv, labelled with their inference, and in sla_report
    out = io.StringIO()
    call_command("sla_report", "ttft-users", "--csv", str(tmp_path), stdout=out)
    text = out.getvalue()
    csv_rows = list(csv.DictReader(io.StringIO((tmp_path / "anytime.csv").read_text())))
    ad = report["anytime"]["variants"]["awq"]["vs_control"]["adjusted"]["mean_ttft_difference"]
    row = next(
        r for r in csv_rows if r["variant"] == "awq" and r["quantity"] == "mean_ttft_difference_adjusted"
    )
    assert (row["inference"], row["adjusted_on"], row["note"]) == (
        "user-clustered",
        "prompt_tokens max_tokens",
        "",
    )
    assert float(row["estimate"]) == pytest.approx(ad["estimate"]) and float(row["lo"]) == pytest.approx(
        ad["lo"]
    )
    assert float(row["variance_reduction"]) == pytest.approx(ad["adjusted"]["variance_reduction"])
    per = report["anytime"]["variants"]["fp16"]["clustered"]["attainment"]
    row = next(r for r in csv_rows if r["variant"] == "fp16" and r["inference"] == "user-clustered")
    assert row["quantity"] == "attainment" and float(row["hi"]) == pytest.approx(per["hi"], abs=1e-6)
    block = text[text.index("Anytime-valid intervals") :]
    e = report["anytime"]["variants"]["awq"]
    assert re.search(rf"\n  awq +requests +{re.escape(interval_text(e['attainment'], '.4f'))} .*p99 ", block)
    assert re.search(
        rf"\n +user-clustered +{re.escape(sequence_text(e['clustered']['attainment'], '.4f'))} .*mean "
        rf"{re.escape(sequence_text(e['clustered']['mean_ttft_ms'], '.1f'))}\n",
        block,
    )
    adjusted = e["vs_control"]["adjusted"]
    assert re.search(
        rf"\n +user-clustered, adjusted +{re.escape(sequence_text(adjusted['attainment_difference'], '+.4f'))}"
        rf" .*mean {re.escape(sequence_text(adjusted['mean_ttft_difference'], '+.1f'))} "
        r"\(on prompt_tokens, max_tokens\)\n",
        block,
    )
    assert report["anytime"]["units"]["note"] in block


@pytest.mark.services  # users_db: the session's ClickHouse server database
def test_anytime_sequences_without_bounds_show_a_dash_and_the_note(client, users, users_db, tmp_path):
    from dashboards.summaries import sequence_text

    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-few/report").json()
    note = f"fewer than {report['anytime']['units']['min_clusters']} units in an arm: no bounds yet"
    rows = anytime_table(client.get("/dashboards/ttft-few/").content.decode())
    for v, e in report["anytime"]["variants"].items():
        got = by_kind(rows, v)
        per = e["clustered"]["attainment"]
        assert per["estimate"] is not None and per["lo"] is None and per["note"] == note
        assert got["clustered"]["cells"][2] == f"{per['estimate']:.4f} [—, —]" == sequence_text(per, ".4f")
        assert got["clustered"]["notes"] == [note]
        assert "inf" not in got["clustered"]["cells"][2]  # not an open side: no bounds yet
        if e["vs_control"]:
            adj = e["vs_control"]["adjusted"]["attainment_difference"]
            assert adj["lo"] is None and adj["note"] == note
            assert got["adjusted"]["cells"][6] == f"{adj['estimate']:+.4f} [—, —]"
            assert got["adjusted"]["notes"] == [note]
            # the request-level sequences beside them have bounds
            assert "—" not in got["requests"]["cells"][6]

    out = io.StringIO()
    call_command("sla_report", "ttft-few", "--csv", str(tmp_path), stdout=out)
    block = out.getvalue()[out.getvalue().index("Anytime-valid intervals") :]
    assert "[—, —]" in block and f"\n                {note}\n" in block
    csv_rows = list(csv.DictReader(io.StringIO((tmp_path / "anytime.csv").read_text())))
    unit_rows = [r for r in csv_rows if r["inference"] == "user-clustered"]
    assert unit_rows and all(r["lo"] == r["hi"] == "" and r["note"] == note for r in unit_rows)
    assert all(
        r["note"] == "" and r["lo"] != ""
        for r in csv_rows
        if r["quantity"] == "attainment_difference" and r["inference"] == "requests"
    )


def test_mirror_mode_shows_each_arms_user_clustered_sequences_and_no_such_differences(
    client, users, samples_db, document, tmp_path
):
    from dashboards.summaries import MIRROR_UNITS_NOTE, interval_text
    from experiments.services import apply_document

    apply_document({**document, "key": "ttft-mirror"}, actor=users["product"])
    _login(client, users, "analyst")
    report = client.get("/api/experiments/ttft-mirror/report").json()
    assert report["runs"]["mode"] == "mirror"
    html = client.get("/dashboards/ttft-mirror/").content.decode()
    rows = anytime_table(html)
    assert [r["kind"] for r in rows] == ["requests", "clustered"] * 3  # no adjusted rows
    for v, e in report["anytime"]["variants"].items():
        got = by_kind(rows, v)
        assert e["clustered"]["attainment"]["lo"] is not None
        assert "—" not in got["clustered"]["cells"][2]
        # no user-clustered or adjusted differences: the arms share their users
        assert got["clustered"]["cells"][6:10] == ["-", "-", "", "-"]
        if e["vs_control"]:
            assert e["vs_control"]["clustered"] is None and e["vs_control"]["adjusted"] is None
            # the request-level differences stay
            assert got["requests"]["cells"][6] == interval_text(
                e["vs_control"]["attainment_difference"], "+.4f"
            )
    assert f"{MIRROR_UNITS_NOTE[0].upper()}{MIRROR_UNITS_NOTE[1:]}." in html

    out = io.StringIO()
    call_command("sla_report", "ttft-mirror", "--csv", str(tmp_path), stdout=out)
    block = out.getvalue()[out.getvalue().index("Anytime-valid intervals") :]
    assert len(re.findall(r"\n {16}user-clustered {2,}\d", block)) == 3  # one per arm, no difference
    assert ", adjusted " not in block
    assert block.count("Δ vs control") == 2 and MIRROR_UNITS_NOTE in block
    csv_rows = list(csv.DictReader(io.StringIO((tmp_path / "anytime.csv").read_text())))
    assert {r["quantity"] for r in csv_rows if r["inference"] == "user-clustered"} == {
        "attainment",
        "error_rate",
        "mean_ttft_ms",
    }
    assert not [r for r in csv_rows if r["quantity"].endswith("_adjusted")]
