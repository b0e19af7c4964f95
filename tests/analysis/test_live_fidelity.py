"""The report's live answers (variants[].fidelity.live): the gateway's shadows of live requests,
read from fidelity_shadows as the gateway writes them, counted exactly against an independent
tally of the rows inserted, and shown by sla_report; on chDB and the ClickHouse server."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from analysis import definitions as q
from analysis import report as r
from samples import synthetic
from stats.clustered import ArmMoments, clustered_mean

T0 = int(synthetic.DEFAULT_START_MS // 1000)  # the first shadow's sent_at: the traffic's start


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)


def live_data() -> synthetic.Synthetic:
    spec = synthetic.SyntheticSpec(
        experiment="fid", mode="live", n=400, seed=3, run_id=41, variants=synthetic.demo_variants(), users=40
    )
    return synthetic.generate(spec)


def info(s: synthetic.SyntheticSpec) -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=s.experiment,
        name=s.experiment,
        slo=q.Slo(200.0),
        target=0.9,
        variants=[r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in s.variants],
    )


def shadow(variant: str, i: int, rng: random.Random, identical_rate: float) -> dict:
    """One shadow row as the gateway writes it: mostly compared, some failing."""
    failed = rng.random() < 0.05
    identical = not failed and rng.random() < identical_rate
    return {
        "experiment": "fid",
        "variant": variant,
        "control": "fp16",
        "request_id": f"{variant}-{i}",
        "user_id": "" if i % 17 == 0 else f"user-{i % 30}",
        "config_revision": 100,
        "sent_at": T0 + i,
        "compared": "live" if i % 3 else "greedy_pair",
        "outcome": "control_error" if failed else "ok",
        "error": "control: HTTP 503" if failed else "",
        "identical": int(identical),
        "first_divergence": -1 if identical or failed else rng.randrange(40),
        "unit": "token",
        "variant_tokens": 40,
        "control_tokens": 40,
        "variant_fp": i + 1,
        "control_fp": i + 1 if identical else i + 2,
    }


def tally(rows: list[dict]) -> dict:
    """Independent of the SQL: counts, the identical share's clustered interval and the
    divergence positions, from the rows themselves."""
    ok = [x for x in rows if x["outcome"] == "ok"]
    users: dict[str, list[int]] = {}
    for x in ok:
        users.setdefault(x["user_id"] or x["request_id"], []).append(x["identical"])
    n = np.array([len(v) for v in users.values()], dtype=float)
    s = np.array([sum(v) for v in users.values()], dtype=float)
    arm = ArmMoments(
        total=np.array([n.sum(), s.sum()]),
        cross=np.array([[n @ n, n @ s], [n @ s, s @ s]]),
        clusters=len(users),
        largest=int(n.max()),
        binary=True,
    )
    positions = sorted(x["first_divergence"] for x in ok if not x["identical"])
    return {
        "shadowed": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "identical": clustered_mean(arm, 0.95),
        "positions": positions,
        "compared_as": {
            k: sum(x["compared"] == k for x in ok)
            for k in ("greedy_pair", "live")
            if any(x["compared"] == k for x in ok)
        },
    }


def test_the_report_reads_each_variants_live_shadows(store):
    data = live_data()
    synthetic.insert(store, data)
    rng = random.Random(5)
    rows = {v: [shadow(v, i, rng, rate) for i in range(300)] for v, rate in (("awq", 0.9), ("awq-fa2", 0.8))}
    store.insert_fidelity_shadows(rows["awq"] + rows["awq-fa2"])
    rep = r.build_report(store, info(data.spec), q.Filters("fid"))
    by = {v["key"]: v["fidelity"] for v in rep["variants"]}
    assert by["fp16"] is None
    for key in ("awq", "awq-fa2"):
        want, fid = tally(rows[key]), by[key]
        assert fid["pairs"] == 0 and fid["identical"] is None  # no mirror pair: live answers alone
        live = fid["live"]
        assert (live["shadowed"], live["ok"], live["failed"]) == (
            want["shadowed"],
            want["ok"],
            want["failed"],
        )
        assert live["failures"] == {"control_error": {"n": want["failed"], "example": "control: HTTP 503"}}
        assert live["compared_as"] == want["compared_as"]
        ident = live["identical"]
        assert ident["estimate"] == pytest.approx(want["identical"].estimate, rel=1e-12)
        assert ident["clusters"] == want["identical"].clusters
        assert (ident["lo"], ident["hi"]) == pytest.approx(
            (want["identical"].lo, want["identical"].hi), rel=1e-9
        )
        pos = live["first_divergence"]
        expanded = [p for p, c in zip(pos["positions"], pos["counts"]) for _ in range(c)]
        assert expanded == want["positions"] and pos["unit"] == "token"
        assert pos["median"] == want["positions"][math.ceil(0.5 * len(want["positions"])) - 1]
        assert pos["p90"] == want["positions"][math.ceil(0.9 * len(want["positions"])) - 1]
    # a time window reads the shadows sent inside it
    import datetime as dt

    since = dt.datetime.fromtimestamp(T0 + 150, dt.UTC)
    windowed = r.build_report(store, info(data.spec), q.Filters("fid", since=since))
    live = next(v for v in windowed["variants"] if v["key"] == "awq")["fidelity"]["live"]
    assert live["shadowed"] == 150
    # sla_report's line
    from dashboards.management.commands.sla_report import render_text

    text = render_text(rep).splitlines()
    live = by["awq"]["live"]
    ident = live["identical"]
    assert (
        f"  awq: live answers {100 * ident['estimate']:.1f}% identical to fp16 [95% CI "
        f"{100 * ident['lo']:.1f}-{100 * ident['hi']:.1f}%], {live['ok']:,} of 300 shadowed compared "
        f"({ident['clusters']:,} clusters); {live['diverged']:,} diverged (median token "
        f"{live['first_divergence']['median']}, p90 {live['first_divergence']['p90']}); "
        f"not compared: control_error {live['failed']:,}"
    ) in text, text


def test_a_report_without_live_traffic_has_no_live_answers(store):
    data = synthetic.generate(
        synthetic.SyntheticSpec(
            experiment="fid",
            mode="mirror",
            n=50,
            seed=1,
            run_id=5,
            variants=synthetic.demo_variants(),
            answers=True,
        )
    )
    synthetic.insert(store, data)
    rep = r.build_report(store, info(data.spec), q.Filters("fid"))
    assert [v["fidelity"]["live"] for v in rep["variants"][1:]] == [None, None]
