"""Answer fidelity in mirror replays: how often a variant's answer is the control's, and where it
parts from it (pure: SQL text and statistics, no driver).

A mirror replay sends every request to every variant, greedily (temperature 0, replay.runner's
``GREEDY_TEMPERATURE``), and each successful answer is fingerprinted as it streams
(fidelity.fingerprints: ``output_fp`` for the whole text, ``token_fps`` one per token chunk). Two
answers of the same request, the control's and a variant's, are paired on (run_id, seq):

- *identical*: the same ``output_fp`` (the same text, however it was cut into chunks);
- *first divergence*: the 0-based chunk position of the first chunk that differs; where one
  answer is a prefix of the other, the position where the shorter ends.

Texts: the answers themselves are kept only where the experiment's document allows it
(``fidelity: {store_answers: true}``, samples.answer_text, at most 16 KiB each). Then the entry
holds a few diverged pairs as examples (``examples_select``): the first ones by (run_id, seq)
whose both texts are stored, each cut to a window around the first character where they differ.
Otherwise ``examples`` is empty and ``examples_note`` says the experiment stores no answers.

Pairs are counted in three kinds: compared (both answered and both fingerprinted), failed (either
side did not answer: no answer, nothing to compare; the latency report counts these), and
unrecorded (both answered, a fingerprint missing: samples written before fingerprints were kept,
or a run that was not a mirror replay).

The share identical is a 0/1 mean per request with the same user-clustered interval as the
report's other shares (stats.clustered, Wilson at the effective sample size): the pairs of one
user share that user's prompts, so they are not independent. Users are the clusters when the
experiment counts users as its unit (analysis.units), requests otherwise; a request with no user is
its own cluster. The store returns the per-cluster moments already summed (``ArmMoments``), a
handful of numbers whatever the number of users.

Two more readings complete the entry. ``kl``: the teacher-forced KL of the scoring pass that
follows a mirror run (``kl_select``, table fidelity_scores: how far a variant's next-token
distributions are from the control's along the control's answers). ``live``: the gateway's
shadows of live requests (``shadows_select``, table fidelity_shadows: live answers against the
control's greedy ones), with the same identical share and first divergence as the mirror pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from analysis.sql import from_where, run_conditions, window_conditions
from analysis.units import UNITS
from fidelity.compare import TRUNCATION
from fidelity.fingerprints import output_fp
from samples.schema import FIDELITY_SCORES_TABLE, FIDELITY_SHADOWS_TABLE
from stats.clustered import ArmMoments, clustered_mean
from stats.quantiles import quantile_rank

COMPARED, FAILED, UNRECORDED = "compared", "failed", "unrecorded"
COMPARES = (
    "greedy answers (temperature 0) of the same requests, the variant's against the control's; "
    "identical = the same text; first divergence = the 0-based position of the first token chunk "
    "that differs (a prefix diverges where it ends)"
)
POSITION_UNIT_TOKENS = "token"  # every compared answer streamed one token per chunk
POSITION_UNIT_CHUNKS = "chunk"  # some chunk held several tokens (speculative decoding, a proxy)
NO_KL = (
    "not measured: no request of the runs read was scored by teacher forcing (the experiment's "
    "fidelity.score_share is 0, or no mirror run read ended while it was above 0)"
)
NO_KL_NOT_YET = (
    "not measured yet: no request of the runs read was scored by teacher forcing (none of them "
    "ended while the experiment's fidelity.score_share was above 0)"
)
NO_KL_SHARE_0 = (
    "not measured: the experiment scores no request (its document's fidelity.score_share is 0); "
    "set it above 0 and the next mirror run's requests are scored by teacher forcing"
)
KL_UNIT = "nats per answer token: each scored request's mean over its answer's tokens, averaged over requests"
# A pair's kind, first divergence and chunking as one number for sumMap: kind * 2^40 +
# (position + 1) * 2 + one token per chunk (positions stay far below 2^39).
KINDS = (COMPARED, FAILED, UNRECORDED)
_KIND_STEP = 1 << 40
_KEY_SQL = (
    f"toUInt64(indexOf(['{COMPARED}', '{FAILED}', '{UNRECORDED}'], kind) - 1) * {_KIND_STEP} "
    "+ toUInt64(position + 1) * 2 + token_chunks"
)


# Examples of diverged answers (stored texts only): how many per variant, and how many characters
# of each text around the first differing one (before it, and from it on).
MAX_EXAMPLES = 3
EXAMPLE_CONTEXT_CHARS = 160
NOT_STORED = (
    "the experiment does not store answers (its document's fidelity.store_answers is false): "
    "only their fingerprints, enough for identical or not and where answers part"
)


def _divergence_sql(c_fps: str, v_fps: str) -> str:
    """SQL: the 0-based position of the first token chunk where two fingerprint arrays differ;
    where one is a prefix of the other, where the shorter ends; -1 where they are equal."""
    common = f"least(length({c_fps}), length({v_fps}))"
    first = (
        f"arrayFirstIndex((a, b) -> a != b, arraySlice({c_fps}, 1, {common}), "
        f"arraySlice({v_fps}, 1, {common}))"
    )
    return f"if({first} > 0, toInt64({first}) - 1, if(length({c_fps}) != length({v_fps}), toInt64({common}), -1))"


def _pairs_sql(f: Any, unit: str) -> tuple[str, dict[str, Any]]:
    """One row per (run_id, seq) pair of the control and the variant, with its kind, whether the
    answers are identical, the first divergence (-1 where there is none) and the cluster key."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    fw, params = from_where(f, ["mode = 'mirror'"])
    side = (
        "SELECT run_id, seq, user_id AS {p}_user, outcome = 'ok' AS {p}_ok, output_fp AS {p}_fp, "
        "token_fps AS {p}_fps, output_tokens AS {p}_tokens {fw} AND variant = %({p}_variant)s"
    )
    key = (
        "cityHash64(if(c_user = '', concat(toString(run_id), ':', toString(seq)), c_user))"
        if unit == "user"
        else "cityHash64(run_id, seq)"
    )
    sql = f"""
        SELECT {key} AS cluster,
               multiIf(NOT (c_ok AND v_ok), '{FAILED}', c_fp = 0 OR v_fp = 0, '{UNRECORDED}', '{COMPARED}') AS kind,
               toUInt8(kind = '{COMPARED}' AND c_fp = v_fp) AS identical,
               if(kind != '{COMPARED}' OR identical, -1, {_divergence_sql("c_fps", "v_fps")}) AS position,
               toUInt8(length(c_fps) = c_tokens AND length(v_fps) = v_tokens) AS token_chunks
        FROM ({side.format(p="c", fw=fw)}) AS c
        ALL INNER JOIN ({side.format(p="v", fw=fw)}) AS v
        USING (run_id, seq)
    """
    return sql, params


def pairs_select(f: Any, unit: str, control: str, variant: str) -> tuple[str, dict[str, Any]]:
    """One row, from one pass over the pairs (a replay still writing cannot make its parts
    disagree): the compared pairs' clusters, the largest cluster's count, the sums over clusters
    of n, s, n^2, n s, s^2 (n compared pairs, s identical ones per cluster), and the pair counts
    as a map of numeric keys (``_KEY_SQL``: ClickHouse 18.16's sumMap takes no string keys) to
    pairs, which ``kinds_of`` reads."""
    pairs, params = _pairs_sql(f, unit)
    sql = f"""
        SELECT countIf(n > 0), max(n), sum(n), sum(s), sum(n * n), sum(n * s), sum(s * s),
               sumMap(tupleElement(m, 1), tupleElement(m, 2))
        FROM (SELECT cluster,
                     toFloat64(countIf(kind = '{COMPARED}')) AS n,
                     toFloat64(sumIf(identical, kind = '{COMPARED}')) AS s,
                     sumMap([{_KEY_SQL}], [toUInt64(1)]) AS m
              FROM ({pairs}) GROUP BY cluster)
    """
    return sql, {**params, "c_variant": control, "v_variant": variant}


def examples_select(f: Any, control: str, variant: str) -> tuple[str, dict[str, Any]]:
    """Up to MAX_EXAMPLES diverged pairs whose both answers have their text stored, the first
    by (run_id, seq): one row each of (run_id, seq, first divergence position, control's text,
    variant's text, control's output_fp, variant's output_fp), in that order.

    The pairs are picked on fingerprints and a stored-or-not flag (no text is held while the
    pairs are joined); only the picked requests' texts are then read. A request recorded twice
    (a run still writing) counts once, its latest recording."""
    fw, params = from_where(f, ["mode = 'mirror'", "outcome = 'ok'", "output_fp != 0"])
    side = (
        "SELECT run_id, seq, output_fp AS {p}_fp, answer_text != '' AS {p}_kept "
        "{fw} AND variant = %({p}_variant)s"
    )
    pick = f"""
        SELECT DISTINCT run_id, seq
        FROM ({side.format(p="c", fw=fw)}) AS c
        ALL INNER JOIN ({side.format(p="v", fw=fw)}) AS v
        USING (run_id, seq)
        WHERE c_fp != v_fp AND c_kept AND v_kept
        ORDER BY run_id, seq
        LIMIT {MAX_EXAMPLES}
    """

    def latest(column: str, p: str) -> str:
        return f"argMaxIf({column}, recorded_ms, variant = %({p}_variant)s)"

    sql = f"""
        SELECT run_id, seq, {_divergence_sql("c_fps", "v_fps")} AS position, c_text, v_text, c_fp, v_fp
        FROM (SELECT run_id, seq,
                     {latest("token_fps", "c")} AS c_fps, {latest("token_fps", "v")} AS v_fps,
                     {latest("answer_text", "c")} AS c_text, {latest("answer_text", "v")} AS v_text,
                     {latest("output_fp", "c")} AS c_fp, {latest("output_fp", "v")} AS v_fp
              {fw} AND variant IN (%(c_variant)s, %(v_variant)s) AND (run_id, seq) IN ({pick})
              GROUP BY run_id, seq)
        ORDER BY run_id, seq
    """
    return sql, {**params, "c_variant": control, "v_variant": variant}


def _answer_window(text: str, fp: int, start: int, end: int) -> dict[str, Any]:
    return {
        "text": text[start:end],
        "chars": len(text),
        # the stored text is not the whole answer the fingerprint was taken of: cut at the cap
        # (streaming.result.ANSWER_TEXT_MAX_BYTES)
        "capped": output_fp([text]) != int(fp),
    }


def example_of(row: Sequence[Any]) -> dict[str, Any]:
    """One of examples_select's rows as a report example: where the texts part (the token chunk
    ``position``, as first_divergence counts it, and the character ``char``), and both texts
    cut to the same window, ``start`` to ``start`` + up to 2 * EXAMPLE_CONTEXT_CHARS characters
    around ``char``."""
    run_id, seq, position, c_text, v_text, c_fp, v_fp = row
    char = next((i for i, (a, b) in enumerate(zip(c_text, v_text)) if a != b), min(len(c_text), len(v_text)))
    start = max(0, char - EXAMPLE_CONTEXT_CHARS)
    end = char + EXAMPLE_CONTEXT_CHARS
    return {
        "run_id": int(run_id),
        "seq": int(seq),
        "position": int(position) if int(position) >= 0 else None,
        "char": char,
        "start": start,
        "control": _answer_window(c_text, c_fp, start, end),
        "variant": _answer_window(v_text, v_fp, start, end),
    }


def with_examples(
    entry: dict[str, Any] | None, store_answers: bool, rows: Sequence[Sequence[Any]] | None
) -> dict[str, Any] | None:
    """``entry`` (fidelity_entry's) with the switch's state and the examples of examples_select's
    ``rows`` (None: not asked, the switch being off)."""
    if entry is None:
        return None
    examples = [example_of(r) for r in rows or ()] if store_answers else []
    if not store_answers:
        note = NOT_STORED
    elif examples:
        note = (
            f"the first {len(examples)} diverged pair(s) by run and seq whose both answers are stored, "
            f"each cut to {EXAMPLE_CONTEXT_CHARS} characters before and from the first that differs"
        )
    elif entry["diverged"]:
        note = "no diverged pair has both answers stored (recorded while the experiment stored none)"
    else:
        note = "no diverged pair"
    return {**entry, "store_answers": bool(store_answers), "examples": examples, "examples_note": note}


def kinds_of(keys: Sequence[int], counts: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """pairs_select's map as rows (kind, position, pairs, pairs streamed one token per chunk)."""
    rows: dict[tuple[str, int], list[int]] = {}
    for key, n in zip(keys, counts, strict=True):
        kind, rest = divmod(int(key), _KIND_STEP)
        position, one_per_chunk = divmod(rest, 2)
        row = rows.setdefault((KINDS[kind], position - 1), [0, 0])
        row[0] += int(n)
        row[1] += int(n) if one_per_chunk else 0
    return [(kind, position, n, k) for (kind, position), (n, k) in sorted(rows.items())]


def arm_moments(row: Sequence[Any]) -> ArmMoments | None:
    """stats.clustered.ArmMoments of the identical share from pairs_select's row; None with no
    compared pair."""
    g, largest, n, s, nn, ns, ss = row
    if not int(g):
        return None
    return ArmMoments(
        total=np.array([float(n), float(s)]),
        cross=np.array([[float(nn), float(ns)], [float(ns), float(ss)]]),
        clusters=int(g),
        largest=int(largest),
        binary=True,
    )


def _quantile(positions: Sequence[int], counts: Sequence[int], q: float) -> int | None:
    """The q-quantile of a distribution given as ascending values and their counts, at the
    project's one rank, stats.quantiles.quantile_rank (ceil(q n) in exact arithmetic)."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = quantile_rank(total, q), 0
    return next(p for p, c in zip(positions, counts, strict=True) if (seen := seen + c) >= rank)


def fidelity_entry(
    moments_row: Sequence[Any] | None, kind_rows: Sequence[Sequence[Any]], control: str, conf: float
) -> dict[str, Any] | None:
    """A variant's ``fidelity`` in the report (docs/report-json.md); None without a single pair
    (no mirror replay of this variant and the control)."""
    counts = {COMPARED: 0, FAILED: 0, UNRECORDED: 0}
    hist: dict[int, int] = {}
    token_chunks = 0
    for kind, position, n, one_per_chunk in kind_rows:
        counts[str(kind)] += int(n)
        if str(kind) == COMPARED:
            token_chunks += int(one_per_chunk)
            if int(position) >= 0:
                hist[int(position)] = hist.get(int(position), 0) + int(n)
    if not sum(counts.values()):
        return None
    arm = arm_moments(moments_row) if moments_row is not None else None
    identical = clustered_mean(arm, conf).as_dict() if arm is not None else None
    if arm is not None and arm.n != counts[COMPARED]:
        raise ValueError(f"fidelity: {arm.n} compared pairs in the moments, {counts[COMPARED]} in the counts")
    positions = sorted(hist)
    pos_counts = [hist[p] for p in positions]
    diverged = sum(pos_counts)
    return {
        "reference": control,
        "compares": COMPARES,
        "pairs": sum(counts.values()),
        "compared": counts[COMPARED],
        "failed": counts[FAILED],
        "unrecorded": counts[UNRECORDED],
        "identical": identical,
        "diverged": diverged,
        "first_divergence": {
            "unit": POSITION_UNIT_TOKENS if token_chunks == counts[COMPARED] else POSITION_UNIT_CHUNKS,
            "positions": positions,
            "counts": pos_counts,
            "median": _quantile(positions, pos_counts, 0.5),
            "p90": _quantile(positions, pos_counts, 0.9),
        },
        "kl": None,
        "kl_note": NO_KL,
    }


def identical_line(key: str, fid: dict[str, Any] | None) -> str | None:
    """ "awq-fa2: 94.0% of answers identical to fp16 (95% CI 92.1-95.5%, 400 compared)"; None without
    a compared pair."""
    if not fid or not fid.get("identical"):
        return None
    ident = fid["identical"]
    ci = ""
    if ident["lo"] is not None:
        ci = f" ({ident['conf']:.0%} CI {100 * ident['lo']:.1f}-{100 * ident['hi']:.1f}%"
        ci += f", {fid['compared']:,} compared)"
    else:
        ci = f" ({fid['compared']:,} compared, no interval)"
    return f"{key}: {100 * ident['estimate']:.1f}% of answers identical to {fid['reference']}{ci}"


def identical_share(fid: dict | None) -> str:
    """A variant's share of answers identical to the control's for the capacity table, "92.3%";
    "-" where nothing was compared."""
    if not fid or not fid.get("identical"):
        return "-"
    return f"{100 * fid['identical']['estimate']:.1f}%"


# ---- teacher-forced KL (the scoring pass's rows: samples.schema.FIDELITY_SCORES_TABLE) --------
#
# After a mirror run, a share of its requests is scored (fidelity/scores.py, workers/
# fidelity_scores.py): per request and variant, the KL of the variant's next-token distributions
# from the control's along the control's answer, summed over the answer's tokens. The report's
# unit is the request: y = kl_sum / positions, the request's mean KL per answer token, averaged
# over the scored requests with the same user-clustered interval as the identical share (a
# ratio mean over clusters, normal). Per request, not per token pooled over requests: a token of
# a long answer then counts less than one of a short answer, but the requests, not the tokens,
# are the independent draws, so the interval is honest; and requests of a user share its prompts,
# so they are clustered by user as everything else.


def _scores_latest(f: Any, control: str) -> tuple[str, dict[str, Any]]:
    """One row per (variant, run, request) of the scores of the runs in scope whose reference is
    ``control``, its latest writing (a pass run again replaces its rows; the table's merges
    may not have caught up): uid, oc, err, pos, ks, km, agree, k and y, the request's mean KL
    per answer token. A time window (since/until) does not apply: the table has no send time."""
    params: dict[str, Any] = {"experiment": f.experiment, "kl_control": control}
    conds = ["experiment = %(experiment)s", "control = %(kl_control)s", *run_conditions(f, params)]
    if f.variants:
        conds.append("variant IN %(variants)s")
        params["variants"] = tuple(f.variants)
    sql = f"""
        SELECT variant, run_id, seq,
               argMax(user_id, scored_ms) AS uid, argMax(outcome, scored_ms) AS oc,
               argMax(error, scored_ms) AS err, argMax(positions, scored_ms) AS pos,
               argMax(kl_sum, scored_ms) AS ks, argMax(kl_max, scored_ms) AS km,
               argMax(top1_agree, scored_ms) AS agree, argMax(top_k, scored_ms) AS k,
               if(pos > 0, ks / pos, 0.) AS y
        FROM {FIDELITY_SCORES_TABLE}
        WHERE {" AND ".join(conds)}
        GROUP BY variant, run_id, seq
    """
    return sql, params


def kl_select(f: Any, unit: str, control: str) -> tuple[str, dict[str, Any]]:
    """Per variant (the control included: its noise floor), from one pass over the latest scores:
    variant, the clusters with a scored request, the largest cluster's count, the sums over
    clusters of n, s, n^2, n s, s^2 (n scored requests, s the sum of their y), the sum of y^2 over
    requests, the answer tokens scored, those whose most likely token agreed, the largest KL at
    one token."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    latest, params = _scores_latest(f, control)
    key = (
        "cityHash64(if(uid = '', concat(toString(run_id), ':', toString(seq)), uid))"
        if unit == "user"
        else "cityHash64(run_id, seq)"
    )
    sql = f"""
        SELECT variant, countIf(n > 0), max(n), sum(n), sum(s), sum(n * n), sum(n * s), sum(s * s),
               sum(yy), sum(tokens), sum(agreed), max(top)
        FROM (SELECT variant, {key} AS cluster,
                     toFloat64(countIf(oc = 'ok')) AS n, sumIf(y, oc = 'ok') AS s,
                     sumIf(y * y, oc = 'ok') AS yy, sumIf(pos, oc = 'ok') AS tokens,
                     sumIf(agree, oc = 'ok') AS agreed, maxIf(km, oc = 'ok') AS top
              FROM ({latest}) GROUP BY variant, cluster)
        GROUP BY variant
    """
    return sql, params


def kl_outcomes_select(f: Any, control: str) -> tuple[str, dict[str, Any]]:
    """Per variant and outcome of the latest scores: variant, outcome, requests, an example
    error, the smallest and largest top_k."""
    latest, params = _scores_latest(f, control)
    sql = f"""
        SELECT variant, oc, count(), any(err), min(k), max(k)
        FROM ({latest}) GROUP BY variant, oc ORDER BY variant, oc
    """
    return sql, params


def kl_rows(moments: Sequence[Sequence[Any]], outcomes: Sequence[Sequence[Any]]) -> dict[str, dict[str, Any]]:
    """kl_select's and kl_outcomes_select's rows as {variant: {"moments": row without the
    variant, "outcomes": {outcome: (requests, example error, min top_k, max top_k)}}}."""
    out: dict[str, dict[str, Any]] = {}
    for variant, *row in moments:
        out.setdefault(str(variant), {"moments": None, "outcomes": {}})["moments"] = tuple(row)
    for variant, outcome, n, error, k_min, k_max in outcomes:
        entry = out.setdefault(str(variant), {"moments": None, "outcomes": {}})
        entry["outcomes"][str(outcome)] = (int(n), str(error), int(k_min), int(k_max))
    return out


def _kl_mean(moments: Sequence[Any] | None, conf: float) -> Any:
    """clustered_mean of y from kl_select's row (without its variant); None with no scored request."""
    if moments is None or not int(moments[0]):
        return None
    g, largest, n, s, nn, ns, ss, yy = moments[:8]
    arm = ArmMoments(
        total=np.array([float(n), float(s)]),
        cross=np.array([[float(nn), float(ns)], [float(ns), float(ss)]]),
        clusters=int(g),
        largest=int(largest),
        sum_yy=float(yy),
    )
    return clustered_mean(arm, conf)


def kl_entry(
    mine: dict[str, Any] | None, control: dict[str, Any] | None, conf: float
) -> dict[str, Any] | None:
    """A variant's ``fidelity.kl`` (docs/report-json.md, "Answer fidelity") from kl_rows' entries
    of the variant and of the control; None where no request of the variant was scored."""
    if not mine or not mine["outcomes"]:
        return None
    outcomes = mine["outcomes"]
    scored = outcomes.get("ok", (0, "", 0, 0))[0]
    failures = {
        o: {"n": n, "example": err} for o, (n, err, _lo, _hi) in sorted(outcomes.items()) if o != "ok"
    }
    k_low = min(lo for _n, _e, lo, _hi in outcomes.values())
    k_high = max(hi for _n, _e, _lo, hi in outcomes.values())
    mean = _kl_mean(mine["moments"], conf)
    m = mine["moments"]
    noise = _kl_mean(control["moments"], conf) if control else None
    note = None
    if failures:
        note = (
            f"{sum(f['n'] for f in failures.values())} of {scored + sum(f['n'] for f in failures.values())} "
        )
        note += "requests picked were not scored: " + "; ".join(
            f"{o} ({f['n']}): {f['example']}" for o, f in failures.items()
        )
    return {
        "unit": KL_UNIT,
        "mean": mean.estimate if mean is not None else None,
        "low": mean.lo if mean is not None else None,
        "high": mean.hi if mean is not None else None,
        "conf": conf,
        "interval": mean.as_dict() if mean is not None else None,
        "requests_scored": scored,
        "requests_failed": sum(f["n"] for f in failures.values()),
        "failures": failures,
        "tokens_scored": int(m[8]) if mean is not None else 0,
        "top_k": k_high if k_low == k_high else None,
        "top_k_range": [k_low, k_high],
        "truncation": TRUNCATION.format(k=k_high if k_low == k_high else f"{k_low}..{k_high}"),
        "max": float(m[10]) if mean is not None else None,
        "top1_agreement": int(m[9]) / int(m[8]) if mean is not None and int(m[8]) else None,
        "control_noise": noise.estimate if noise is not None else None,
        "note": note,
    }


def with_kl(
    entry: dict[str, Any] | None,
    mine: dict[str, Any] | None,
    control: dict[str, Any] | None,
    conf: float,
    score_share: float | None,
) -> dict[str, Any] | None:
    """``entry`` (fidelity_entry's) with its ``kl`` and ``kl_note``: the scores where the runs
    read have some, else null and why (the share is 0, or nothing scored yet; ``score_share``
    None: not known, both reasons named)."""
    if entry is None:
        return None
    kl = kl_entry(mine, control, conf)
    if kl is not None:
        note = kl["truncation"]
    else:
        if score_share is None:
            note = NO_KL
        else:
            note = NO_KL_SHARE_0 if score_share <= 0 else NO_KL_NOT_YET
    return {**entry, "kl": kl, "kl_note": note}


def _nats(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def kl_text(fid: dict[str, Any] | None) -> str:
    """A variant's mean KL with its interval for a table, "1.61e-05 [1.57e-05, 1.65e-05]"; "-"
    where nothing was scored."""
    kl = (fid or {}).get("kl")
    if not kl or kl["mean"] is None:
        return "-"
    if kl["low"] is None:
        return f"{_nats(kl['mean'])} (no interval)"
    return f"{_nats(kl['mean'])} [{_nats(kl['low'])}, {_nats(kl['high'])}]"


def kl_line(key: str, fid: dict[str, Any] | None) -> str | None:
    """ "awq: KL 1.61e-05 nats per answer token [95% CI ...] from fp16 (48 requests, ...)"; None
    where the variant's requests were not scored at all."""
    kl = (fid or {}).get("kl")
    if not kl:
        return None
    failed = ", ".join(f"{o} {f['n']:,}" for o, f in kl["failures"].items())
    if kl["mean"] is None:
        first = next(iter(kl["failures"].values()), {"example": ""})
        return (
            f"{key}: KL not measured: {kl['requests_failed']:,} requests picked, none scored "
            f"({failed}: {first['example']})"
        )
    ci = (
        f" [{kl['conf']:.0%} CI {_nats(kl['low'])}-{_nats(kl['high'])}]"
        if kl["low"] is not None
        else " (no interval)"
    )
    k = kl["top_k"] if kl["top_k"] is not None else "k"
    line = (
        f"{key}: KL {_nats(kl['mean'])} nats per answer token{ci} from {fid['reference']}, top-{k} "
        f"truncated ({kl['requests_scored']:,} requests, {kl['tokens_scored']:,} tokens); "
        f"top-1 agreement {100 * kl['top1_agreement']:.1f}%; largest at one token {_nats(kl['max'])}; "
        f"{fid['reference']} against itself {_nats(kl['control_noise'])}"
    )
    if failed:
        line += f"; {kl['requests_failed']:,} not scored ({failed})"
    return line


# ---- live answers: the gateway's shadows (samples.schema.FIDELITY_SHADOWS_TABLE) -------------
#
# A share of the live requests a variant served is sent again to the control greedily (and to
# the variant too when the live request was not greedy) by the gateway, and the two answers'
# fingerprints are compared there: one row per shadowed request. The report reads the experiment's
# shadows in its time window (all of them without one; a shadow carries no run), the latest
# writing of each request, and gives per variant the identical share among those compared ("ok")
# with the user-clustered interval the mirror pairs get, and where the others part.

LIVE_COMPARES = (
    "live answers of a share of the variant's requests, each against the control's greedy answer "
    "to the same request sent again by the gateway (compared 'live': the live answer was greedy "
    "and is compared as served; 'greedy_pair': both sent again greedily)"
)


def _shadows_latest(f: Any, control: str) -> tuple[str, dict[str, Any]]:
    """One row per (variant, request) of the experiment's shadows against ``control`` in the
    report's time window, its latest writing: uid, oc, err, cmp, ident, fd, un."""
    params: dict[str, Any] = {"experiment": f.experiment, "live_control": control}
    conds = ["experiment = %(experiment)s", "control = %(live_control)s", *window_conditions(f, params)]
    sql = f"""
        SELECT variant, request_id,
               argMax(user_id, recorded_ms) AS uid, argMax(outcome, recorded_ms) AS oc,
               argMax(error, recorded_ms) AS err, argMax(compared, recorded_ms) AS cmp,
               argMax(identical, recorded_ms) AS ident, argMax(first_divergence, recorded_ms) AS fd,
               argMax(unit, recorded_ms) AS un
        FROM {FIDELITY_SHADOWS_TABLE}
        WHERE {" AND ".join(conds)}
        GROUP BY variant, request_id
    """
    return sql, params


def shadows_select(f: Any, unit: str, control: str) -> tuple[str, dict[str, Any]]:
    """Per variant, the identical share's moments over the compared shadows (outcome "ok"), as
    pairs_select's: variant, clusters, largest, sums of n, s, n^2, n s, s^2."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    latest, params = _shadows_latest(f, control)
    key = "cityHash64(if(uid = '', request_id, uid))" if unit == "user" else "cityHash64(request_id)"
    sql = f"""
        SELECT variant, countIf(n > 0), max(n), sum(n), sum(s), sum(n * n), sum(n * s), sum(s * s)
        FROM (SELECT variant, {key} AS cluster, toFloat64(countIf(oc = 'ok')) AS n,
                     toFloat64(sumIf(ident, oc = 'ok')) AS s
              FROM ({latest}) GROUP BY variant, cluster)
        GROUP BY variant
    """
    return sql, params


def shadow_kinds_select(f: Any, control: str) -> tuple[str, dict[str, Any]]:
    """Per variant the shadows counted by outcome, how they were compared, first divergence (-1:
    identical or not compared) and unit, with an example error: variant, oc, cmp, fd, un, count,
    error."""
    latest, params = _shadows_latest(f, control)
    sql = f"""
        SELECT variant, oc, cmp, if(oc = 'ok' AND ident = 0, fd, -1) AS pos, un, count(), any(err)
        FROM ({latest}) GROUP BY variant, oc, cmp, pos, un ORDER BY variant, oc, cmp, pos, un
    """
    return sql, params


def shadow_rows(
    moments: Sequence[Sequence[Any]], kinds: Sequence[Sequence[Any]]
) -> dict[str, dict[str, Any]]:
    """shadows_select's and shadow_kinds_select's rows as {variant: {"moments", "kinds"}}."""
    out: dict[str, dict[str, Any]] = {}
    for variant, *row in moments:
        out.setdefault(str(variant), {"moments": None, "kinds": []})["moments"] = tuple(row)
    for variant, *row in kinds:
        out.setdefault(str(variant), {"moments": None, "kinds": []})["kinds"].append(tuple(row))
    return out


def live_entry(got: dict[str, Any] | None, conf: float) -> dict[str, Any] | None:
    """A variant's ``fidelity.live`` (docs/report-json.md, "Answer fidelity"); None without a
    shadow."""
    if not got or not got["kinds"]:
        return None
    shadowed = ok = 0
    how: dict[str, int] = {}
    failures: dict[str, dict[str, Any]] = {}
    hist: dict[int, int] = {}
    units: set[str] = set()
    for outcome, compared, position, unit, n, error in got["kinds"]:
        n = int(n)
        shadowed += n
        if str(outcome) != "ok":
            f = failures.setdefault(str(outcome), {"n": 0, "example": str(error)})
            f["n"] += n
            continue
        ok += n
        how[str(compared)] = how.get(str(compared), 0) + n
        if int(position) >= 0:
            hist[int(position)] = hist.get(int(position), 0) + n
            units.add(str(unit))
    arm = arm_moments(got["moments"]) if got["moments"] is not None else None
    if arm is not None and arm.n != ok:
        raise ValueError(f"fidelity.live: {arm.n} compared shadows in the moments, {ok} in the counts")
    positions = sorted(hist)
    counts = [hist[p] for p in positions]
    return {
        "compares": LIVE_COMPARES,
        "shadowed": shadowed,
        "ok": ok,
        "compared_as": dict(sorted(how.items())),
        "failed": shadowed - ok,
        "failures": dict(sorted(failures.items())),
        "identical": clustered_mean(arm, conf).as_dict() if arm is not None else None,
        "diverged": sum(counts),
        "first_divergence": {
            "unit": POSITION_UNIT_TOKENS if units <= {POSITION_UNIT_TOKENS} else POSITION_UNIT_CHUNKS,
            "positions": positions,
            "counts": counts,
            "median": _quantile(positions, counts, 0.5),
            "p90": _quantile(positions, counts, 0.9),
        },
    }


def empty_entry(control: str) -> dict[str, Any]:
    """A variant's ``fidelity`` where no mirror pair was read but live shadows were: the mirror
    fields at nothing compared (with_examples, with_kl and with_live complete it)."""
    return {
        "reference": control,
        "compares": COMPARES,
        "pairs": 0,
        "compared": 0,
        "failed": 0,
        "unrecorded": 0,
        "identical": None,
        "diverged": 0,
        "first_divergence": {
            "unit": POSITION_UNIT_TOKENS,
            "positions": [],
            "counts": [],
            "median": None,
            "p90": None,
        },
        "kl": None,
        "kl_note": NO_KL,
    }


def with_live(entry: dict[str, Any] | None, live: dict[str, Any] | None) -> dict[str, Any] | None:
    """``entry`` with its ``live`` (None: no shadow of the variant in the report's window)."""
    return None if entry is None else {**entry, "live": live}


def live_line(key: str, fid: dict[str, Any] | None) -> str | None:
    """ "awq: live answers 93.5% identical to fp16 [95% CI 90.1-96.0%] of 400 shadowed ..."; None
    without a shadow."""
    live = (fid or {}).get("live")
    if not live:
        return None
    line = f"{key}: live answers "
    ident = live["identical"]
    if ident is None:
        line += f"none compared of {live['shadowed']:,} shadowed"
    else:
        ci = (
            f" [{ident['conf']:.0%} CI {100 * ident['lo']:.1f}-{100 * ident['hi']:.1f}%]"
            if ident["lo"] is not None
            else " (no interval)"
        )
        line += (
            f"{100 * ident['estimate']:.1f}% identical to {fid['reference']}{ci}, {live['ok']:,} of "
            f"{live['shadowed']:,} shadowed compared ({ident['clusters']:,} clusters)"
        )
        pos = live["first_divergence"]
        if pos["median"] is not None:
            line += (
                f"; {live['diverged']:,} diverged (median {pos['unit']} {pos['median']}, p90 {pos['p90']})"
            )
    if live["failures"]:
        line += "; not compared: " + ", ".join(f"{o} {f['n']:,}" for o, f in live["failures"].items())
    return line
