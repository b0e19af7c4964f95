"""Answer fidelity in the report: the share of a variant's answers identical to the control's, with
its user-clustered interval, and the first divergence positions, checked against the truth the
synthetic answers were made with, on chDB and on the ClickHouse server."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from analysis import answer_fidelity as af
from analysis import definitions as q
from analysis import report as r
from fidelity import fingerprints
from samples import synthetic
from stats.clustered import ArmMoments, clustered_mean

RATES = {"fp16": 0.0, "awq": 0.06, "awq-fa2": 0.08}


def spec(**over) -> synthetic.SyntheticSpec:
    base = dict(
        experiment="fid",
        mode="mirror",
        n=1_500,
        seed=21,
        run_id=31,
        variants=[dataclasses.replace(v, divergence_rate=RATES[v.key]) for v in synthetic.demo_variants()],
        users=200,
        user_sigma=0.3,
        no_user_share=0.05,
        duration_s=300.0,
        answers=True,
    )
    return synthetic.SyntheticSpec(**{**base, **over})


def few(n: int, **over) -> synthetic.Synthetic:
    """``n`` requests, every one answered by every variant, without users: a test writes the
    answers it needs into a copy of the columns."""
    no_errors = [dataclasses.replace(v, error_rate=0.0) for v in spec().variants]
    return synthetic.generate(spec(n=n, users=0, no_user_share=0.0, variants=no_errors, **over))


def info(
    s: synthetic.SyntheticSpec, cluster_by_user: bool = True, store_answers: bool = False
) -> r.ExperimentInfo:
    return r.ExperimentInfo(
        key=s.experiment,
        name=s.experiment,
        slo=q.Slo(200.0),
        target=0.9,
        variants=[r.VariantInfo(v.key, v.control, v.weight, dict(v.factors)) for v in s.variants],
        cluster_by_user=cluster_by_user,
        store_answers=store_answers,
    )


def truth(data: synthetic.Synthetic, variant: str, by_user: bool) -> dict:
    """Independent of the SQL: pairs by seq from the generated columns and the divergence truth."""
    cols, dv = data.columns, data.diverged_at
    ok = cols["outcome"] == "ok"
    by = {}
    for key in ("fp16", variant):
        m = cols["variant"] == key
        by[key] = {int(s): i for s, i in zip(cols["seq"][m], np.flatnonzero(m))}
    compared, identical, failed, positions = 0, 0, 0, {}
    clusters: dict[str, list[int]] = {}
    for seq, ci in by["fp16"].items():
        vi = by[variant][seq]
        if not (ok[ci] and ok[vi]):
            failed += 1
            continue
        compared += 1
        same = dv[vi] < 0 and dv[ci] < 0
        identical += same
        if not same:
            positions[int(dv[vi])] = positions.get(int(dv[vi]), 0) + 1
        user = cols["user_id"][ci]
        key = user if by_user and user else f"req{seq}"
        clusters.setdefault(key, [0, 0])
        clusters[key][0] += 1
        clusters[key][1] += same
    n = np.array([c[0] for c in clusters.values()], float)
    s = np.array([c[1] for c in clusters.values()], float)
    m = s.sum() / n.sum()
    g = n.size
    se = math.sqrt(g / (g - 1) * ((s - m * n) ** 2).sum()) / n.sum()
    return {
        "compared": compared,
        "identical": identical,
        "failed": failed,
        "positions": positions,
        "share": m,
        "se": se,
        "clusters": g,
    }


@pytest.fixture(scope="module")
def data() -> synthetic.Synthetic:
    return synthetic.generate(spec())


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)


@pytest.mark.parametrize("by_user", [True, False])
def test_the_report_counts_identical_answers_and_divergences_as_they_were_made(store, data, by_user):
    synthetic.insert(store, data)
    rep = r.build_report(store, info(data.spec, by_user), q.Filters("fid"))
    rows = {v["key"]: v for v in rep["variants"]}
    assert rows["fp16"]["fidelity"] is None  # the reference is not compared with itself
    for key in ("awq", "awq-fa2"):
        want = truth(data, key, by_user)
        fid = rows[key]["fidelity"]
        assert fid["reference"] == "fp16"
        assert (fid["compared"], fid["failed"], fid["unrecorded"]) == (want["compared"], want["failed"], 0)
        assert fid["pairs"] == data.spec.n
        ident = fid["identical"]
        assert ident["n"] == want["compared"] and ident["clusters"] == want["clusters"]
        assert ident["estimate"] == pytest.approx(want["share"], abs=1e-12)
        assert ident["se"] == pytest.approx(want["se"], rel=1e-9)
        assert ident["lo"] < ident["estimate"] < ident["hi"]
        # exact positions, every one of them
        pos = fid["first_divergence"]
        assert dict(zip(pos["positions"], pos["counts"])) == want["positions"]
        assert fid["diverged"] == want["compared"] - want["identical"] > 0
        assert pos["unit"] == af.POSITION_UNIT_TOKENS  # one fingerprint per counted token
        ordered = sorted(p for p, c in want["positions"].items() for _ in range(c))
        assert pos["median"] == ordered[math.ceil(0.5 * len(ordered)) - 1]
        assert pos["p90"] == ordered[math.ceil(0.9 * len(ordered)) - 1]
        assert fid["kl"] is None and fid["kl_note"] == af.NO_KL
    fid = rows["awq-fa2"]["fidelity"]
    ident = fid["identical"]
    line = af.identical_line("awq-fa2", fid)
    assert line == (
        f"awq-fa2: {100 * ident['estimate']:.1f}% of answers identical to fp16 "
        f"(95% CI {100 * ident['lo']:.1f}-{100 * ident['hi']:.1f}%, {fid['compared']:,} compared)"
    )
    # what an analyst reads: the first screen's column, and sla_report's section
    from dashboards import summaries
    from dashboards.management.commands.sla_report import render_text

    first = {row["variant"]: row for row in summaries.answer(rep)["rows"]}
    assert summaries.answer(rep)["fidelity"] and first["fp16"]["identical"] == "reference"
    assert first["awq-fa2"]["identical"] == f"{ident['estimate']:.1%} [{ident['lo']:.1%}, {ident['hi']:.1%}]"
    text = render_text(rep)
    assert f"Answers against fp16 ({af.COMPARES}):" in text
    pos = fid["first_divergence"]
    assert (
        f"  awq-fa2     identical {first['awq-fa2']['identical']:<26}of {fid['compared']:,} compared "
        f"({ident['clusters']:,} clusters); {fid['diverged']:,} diverged (median token {pos['median']}, "
        f"p90 {pos['p90']}); {fid['failed']:,} not compared (either side failed)"
    ) in text.splitlines()
    assert f"  KL divergence: {af.NO_KL}" in text
    # the dashboard's curve: rises at each first divergence to the share that parted at all
    from dashboards import charts

    drawn = {c["id"]: c for c in charts.all_figures(rep)}["divergence"]["figure"]
    curve = {t["name"].split(" ")[0]: t for t in drawn["data"]}
    assert set(curve) == {"awq", "awq-fa2"}
    assert curve["awq-fa2"]["x"] == [0, *pos["positions"]]
    assert curve["awq-fa2"]["y"][-1] == pytest.approx(fid["diverged"] / fid["compared"])


def test_rows_without_fingerprints_are_counted_unrecorded_not_compared(store):
    old = synthetic.generate(spec(answers=False))  # as samples written before fingerprints were kept
    synthetic.insert(store, old)
    rep = r.build_report(store, info(old.spec), q.Filters("fid"))
    awq = next(v for v in rep["variants"] if v["key"] == "awq")["fidelity"]
    ok = old.columns["outcome"] == "ok"
    seqs = {k: set(old.columns["seq"][(old.columns["variant"] == k) & ok].tolist()) for k in ("fp16", "awq")}
    both = len(seqs["fp16"] & seqs["awq"])
    assert (awq["compared"], awq["unrecorded"], awq["failed"]) == (0, both, old.spec.n - both)
    assert awq["identical"] is None and awq["diverged"] == 0 and awq["first_divergence"]["median"] is None
    assert af.identical_line("awq", awq) is None


def test_split_runs_have_no_fidelity(store):
    split = synthetic.generate(spec(mode="split", answers=False, n=300))
    synthetic.insert(store, split)
    rep = r.build_report(store, info(split.spec), q.Filters("fid"))
    assert all(v["fidelity"] is None for v in rep["variants"])
    from dashboards import charts

    assert "divergence" not in {c["id"] for c in charts.all_figures(rep)}  # no empty section either


def test_prefixes_and_chunking_are_placed_where_they_part(store):
    # four requests, all answered: fp16's answer [1, 2, 3] each time; awq's: the same, a prefix,
    # a longer answer, one differing in the middle
    small = few(4)
    cols = {k: v.copy() for k, v in small.columns.items()}
    answers = {"fp16": [[1, 2, 3]] * 4, "awq": [[1, 2, 3], [1, 2], [1, 2, 3, 4], [1, 9, 3]]}
    answers["awq-fa2"] = answers["fp16"]
    for i in range(cols["seq"].size):
        tokens = answers[cols["variant"][i]][int(cols["seq"][i])]
        cols["token_fps"][i] = np.asarray(tokens, dtype=np.uint32)
        cols["output_fp"][i] = 1 + sum(t * 7**j for j, t in enumerate(tokens))
        cols["output_tokens"][i] = len(tokens)
    store.insert_columns(cols)
    rep = r.build_report(store, info(small.spec), q.Filters("fid"))
    rows = {v["key"]: v["fidelity"] for v in rep["variants"]}
    awq = rows["awq"]
    assert (awq["compared"], awq["diverged"]) == (4, 3)
    assert dict(zip(awq["first_divergence"]["positions"], awq["first_divergence"]["counts"])) == {
        1: 1,
        2: 1,
        3: 1,
    }
    assert awq["identical"]["estimate"] == 0.25 and awq["identical"]["clusters"] == 4
    assert rows["awq-fa2"]["identical"]["estimate"] == 1.0 and rows["awq-fa2"]["diverged"] == 0
    # every request one chunk per token here; a chunk of two tokens makes positions chunk positions
    cols["output_tokens"][(cols["variant"] == "awq") & (cols["seq"] == 3)] = 4
    cols["recorded_ms"] = cols["recorded_ms"] + 1  # the newer recording replaces the older
    store.insert_columns(cols)
    store.deduplicate()
    rep = r.build_report(store, info(small.spec), q.Filters("fid"))
    awq = next(v for v in rep["variants"] if v["key"] == "awq")["fidelity"]
    assert awq["first_divergence"]["unit"] == af.POSITION_UNIT_CHUNKS and awq["compared"] == 4


# ---- examples: the texts of a few diverged pairs, where the experiment stores them --------------


def diverged_truth(data: synthetic.Synthetic, variant: str) -> list[dict]:
    """Every diverged pair of ``variant`` by seq, from the generated columns and the truth they
    were made with: where the tokens part, and the character where the texts then part."""
    cols, dv = data.columns, data.diverged_at
    rows = {(str(v), int(q_)): i for i, (v, q_) in enumerate(zip(cols["variant"], cols["seq"]))}
    out = []
    for seq in range(data.spec.n):
        ci, vi = rows[("fp16", seq)], rows[(variant, seq)]
        if cols["outcome"][ci] != "ok" or cols["outcome"][vi] != "ok" or dv[vi] < 0:
            continue
        d = int(dv[vi])
        a, b = (f"{int(cols['token_fps'][i][d]):08x}" for i in (ci, vi))
        digit = next(k for k in range(8) if a[k] != b[k])
        out.append({"seq": seq, "position": d, "char": 9 * d + digit, "texts": (ci, vi)})
    return out


def test_the_report_shows_a_few_diverged_answers_only_where_the_experiment_stores_them(store):
    data = synthetic.generate(spec(n=400, answer_texts=True))
    synthetic.insert(store, data)
    off = r.build_report(store, info(data.spec), q.Filters("fid"))
    for v in off["variants"][1:]:
        fid = v["fidelity"]
        assert (fid["store_answers"], fid["examples"], fid["examples_note"]) == (False, [], af.NOT_STORED)
    on = r.build_report(store, info(data.spec, store_answers=True), q.Filters("fid"))
    rows = {v["key"]: v["fidelity"] for v in on["variants"]}
    assert rows["fp16"] is None
    texts = data.columns["answer_text"]
    for key in ("awq", "awq-fa2"):
        fid, want = rows[key], diverged_truth(data, key)[: af.MAX_EXAMPLES]
        assert fid["store_answers"] is True and len(want) == af.MAX_EXAMPLES
        assert fid["examples_note"].startswith(f"the first {af.MAX_EXAMPLES} diverged pair(s) by run and seq")
        # the same counts as without the switch: examples add to the entry, they change nothing
        assert {k: fid[k] for k in ("compared", "diverged", "identical", "first_divergence")} == {
            k: off["variants"][[v["key"] for v in off["variants"]].index(key)]["fidelity"][k]
            for k in ("compared", "diverged", "identical", "first_divergence")
        }
        assert [e["seq"] for e in fid["examples"]] == [w["seq"] for w in want]  # the lowest seqs
        for ex, w in zip(fid["examples"], want, strict=True):
            ci, vi = w["texts"]
            start = max(0, w["char"] - af.EXAMPLE_CONTEXT_CHARS)
            end = w["char"] + af.EXAMPLE_CONTEXT_CHARS
            assert (ex["run_id"], ex["position"], ex["char"], ex["start"]) == (
                31,
                w["position"],
                w["char"],
                start,
            )
            assert ex["control"] == {"text": texts[ci][start:end], "chars": len(texts[ci]), "capped": False}
            assert ex["variant"] == {"text": texts[vi][start:end], "chars": len(texts[vi]), "capped": False}
            assert ex["control"]["text"][: w["char"] - start] == ex["variant"]["text"][: w["char"] - start]
            assert ex["control"]["text"][w["char"] - start] != ex["variant"]["text"][w["char"] - start]


def test_examples_need_both_texts_and_say_when_a_text_was_capped(store):
    # three requests, all diverged at token 1: the first without the variant's text (recorded
    # before the switch was on), the second's control text capped (not the answer its output_fp
    # is of), the third whole
    small = few(3, answer_texts=True)
    cols = {k: v.copy() for k, v in small.columns.items()}
    for i in range(cols["seq"].size):
        tokens = [7, 8, 9] if cols["variant"][i] == "fp16" else [7, 5, 9]
        cols["token_fps"][i] = np.asarray(tokens, dtype=np.uint32)
        cols["answer_text"][i] = synthetic.answer_text_of(tokens)
        cols["output_fp"][i] = fingerprints.output_fp([cols["answer_text"][i]])
        cols["output_tokens"][i] = 3
    awq = cols["variant"] == "awq"
    cols["answer_text"][awq & (cols["seq"] == 0)] = ""
    capped = (cols["variant"] == "fp16") & (cols["seq"] == 1)
    cols["answer_text"][capped] = cols["answer_text"][capped][0][:12]
    store.insert_columns(cols)
    rep = r.build_report(store, info(small.spec, store_answers=True), q.Filters("fid"))
    fid = next(v for v in rep["variants"] if v["key"] == "awq")["fidelity"]
    assert fid["diverged"] == 3 and [e["seq"] for e in fid["examples"]] == [1, 2]
    first, second = fid["examples"]
    # the tokens part at 1 (00000008 / 00000005: the 8th hex digit); the capped text ends before
    assert (second["position"], second["char"], second["start"]) == (1, 9 + 7, 0)
    assert (first["position"], first["char"]) == (1, 12)
    assert first["control"] == {"text": "00000007\u00b7000", "chars": 12, "capped": True}
    assert first["variant"]["capped"] is False and second["control"]["capped"] is False
    # awq-fa2 answered as awq did, with every text: three examples, and none when nothing parted
    assert len(next(v for v in rep["variants"] if v["key"] == "awq-fa2")["fidelity"]["examples"]) == 3
    cols["token_fps"] = cols["token_fps"].copy()
    for i in np.flatnonzero(cols["variant"] != "fp16"):
        cols["token_fps"][i] = np.asarray([7, 8, 9], dtype=np.uint32)
        cols["answer_text"][i] = synthetic.answer_text_of([7, 8, 9])
        cols["output_fp"][i] = fingerprints.output_fp([cols["answer_text"][i]])
    cols["recorded_ms"] = cols["recorded_ms"] + 1  # the newer recordings replace the older
    store.insert_columns(cols)
    store.deduplicate()
    rep = r.build_report(store, info(small.spec, store_answers=True), q.Filters("fid"))
    fid = next(v for v in rep["variants"] if v["key"] == "awq")["fidelity"]
    assert (fid["examples"], fid["examples_note"]) == ([], "no diverged pair")


def test_the_examples_query_reads_texts_only_when_the_switch_is_on(store):
    from analysis.readers.raw import RawReader

    data = synthetic.generate(spec(n=50, answer_texts=True))
    synthetic.insert(store, data)
    calls = []
    query = store.query
    store.query = lambda sql, params=None, **kw: calls.append(sql) or query(sql, params, **kw)
    off = RawReader(store).fidelity_pairs(q.Filters("fid"), "user", "fp16", "awq")
    assert "examples" not in off and not any("answer_text" in sql for sql in calls)
    on = RawReader(store).fidelity_pairs(q.Filters("fid"), "user", "fp16", "awq", examples=True)
    assert len(on["examples"]) == min(af.MAX_EXAMPLES, len(diverged_truth(data, "awq")))
    assert on["moments"] == off["moments"] and on["kinds"] == off["kinds"]


def test_an_example_is_cut_around_where_the_texts_part():
    c_text = "a" * 500 + "é" * 10 + "b" * 500
    v_text = "a" * 500 + "é" * 5 + "ç" + "b" * 20
    fp = fingerprints.output_fp
    ex = af.example_of((4, 17, 123, c_text, v_text, fp([c_text]), fp([c_text])))
    assert (ex["run_id"], ex["seq"], ex["position"], ex["char"]) == (4, 17, 123, 505)
    assert ex["start"] == 505 - af.EXAMPLE_CONTEXT_CHARS
    assert ex["control"]["text"] == c_text[ex["start"] : 505 + af.EXAMPLE_CONTEXT_CHARS]
    assert ex["variant"]["text"] == v_text[ex["start"] :]  # shorter than the window
    assert (ex["control"]["capped"], ex["variant"]["capped"]) == (False, True)
    # a prefix parts where it ends; a collision of fingerprints has no position
    ex = af.example_of((1, 0, -1, "abc", "abcd", fp(["abc"]), fp(["abcd"])))
    assert (ex["char"], ex["start"], ex["position"]) == (3, 0, None)
    assert af.with_examples(None, True, []) is None


# ---- the pure part ---------------------------------------------------------------------------


def test_the_entry_takes_the_stores_moments_as_the_clustered_mean_does():
    n, s = np.array([3.0, 1.0, 2.0]), np.array([3.0, 0.0, 1.0])
    row = (3, 3, n.sum(), s.sum(), (n * n).sum(), (n * s).sum(), (s * s).sum())
    kinds = [("compared", -1, 4, 4), ("compared", 5, 1, 1), ("compared", 0, 1, 0), ("failed", -1, 2, 0)]
    fid = af.fidelity_entry(row, kinds, "fp16", 0.95)
    want = clustered_mean(ArmMoments.from_clusters(n, s, binary=True), 0.95).as_dict()
    assert fid["identical"] == want
    assert (fid["pairs"], fid["compared"], fid["failed"], fid["diverged"]) == (8, 6, 2, 2)
    assert fid["first_divergence"]["unit"] == af.POSITION_UNIT_CHUNKS  # 5 of 6 one chunk per token
    assert fid["first_divergence"]["positions"] == [0, 5] and fid["first_divergence"]["median"] == 0


def test_the_entry_refuses_moments_that_disagree_with_the_counts():
    row = (1, 2, 2.0, 1.0, 4.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="2 compared pairs in the moments, 3 in the counts"):
        af.fidelity_entry(row, [("compared", -1, 3, 3)], "fp16", 0.95)


def test_no_pairs_no_entry_and_the_unit_is_checked():
    assert af.fidelity_entry((0, 0, 0, 0, 0, 0, 0), [], "fp16", 0.95) is None
    with pytest.raises(ValueError, match="unit must be one of"):
        af.pairs_select(q.Filters("x"), "session", "a", "b")


def test_the_line_says_no_interval_with_one_user():
    row = (1, 5, 5.0, 4.0, 25.0, 20.0, 16.0)
    fid = af.fidelity_entry(row, [("compared", -1, 4, 5), ("compared", 2, 1, 1)], "fp16", 0.95)
    assert (
        af.identical_line("awq", fid) == "awq: 80.0% of answers identical to fp16 (5 compared, no interval)"
    )


def test_the_pairs_are_read_in_one_query_so_a_replay_still_writing_cannot_split_them(store, data):
    # moments and counts from two queries disagreed when rows landed between them (a dashboard
    # refreshed during a mirror replay): one query reads both
    from analysis.readers.raw import RawReader

    synthetic.insert(store, data)
    calls = []
    query = store.query
    store.query = lambda sql, params=None, **kw: calls.append(sql) or query(sql, params, **kw)
    got = RawReader(store).fidelity_pairs(q.Filters("fid"), "user", "fp16", "awq")
    assert len(calls) == 1
    fid = af.fidelity_entry(got["moments"], got["kinds"], "fp16", 0.95)
    assert fid["identical"]["n"] == fid["compared"] == truth(data, "awq", True)["compared"]


def test_the_kind_keys_read_back_as_written():
    keys = [
        0 * (1 << 40) + 0 * 2 + 1,
        0 * (1 << 40) + 6 * 2 + 0,
        1 * (1 << 40) + 0 * 2,
        2 * (1 << 40) + 0 * 2 + 1,
    ]
    assert af.kinds_of(keys, [5, 2, 3, 4]) == [
        ("compared", -1, 5, 5),
        ("compared", 5, 2, 0),
        ("failed", -1, 3, 0),
        ("unrecorded", -1, 4, 4),
    ]


def test_divergence_quantiles_take_the_projects_one_rank_whatever_the_count():
    # positions with counts read as the expanded values do through stats.quantiles.nearest_rank
    # (ceil(q n) in exact arithmetic: in floats 0.9 * n lands above an integer for some n)
    from stats.quantiles import nearest_rank

    rng = np.random.default_rng(3)
    for total in range(1, 400):
        counts = np.bincount(rng.integers(0, 40, total), minlength=40)
        positions = [int(p) for p in np.flatnonzero(counts)]
        kept = [int(counts[p]) for p in positions]
        values = [p for p, c in zip(positions, kept) for _ in range(c)]
        for level in (0.5, 0.9):
            assert af._quantile(positions, kept, level) == nearest_rank(values, level), (total, level)
