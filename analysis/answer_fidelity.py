"""Answer fidelity in mirror replays: how often a variant's answer is the control's, and where it
parts from it (pure: SQL text and statistics, no driver).

A mirror replay sends every request to every variant, greedily (temperature 0, replay.runner's
``GREEDY_TEMPERATURE``), and each successful answer is fingerprinted as it streams
(fidelity.fingerprints: ``output_fp`` for the whole text, ``token_fps`` one per token chunk). Two
answers of the same request, the control's and a variant's, are paired on (run_id, seq):

- *identical*: the same ``output_fp`` (the same text, however it was cut into chunks);
- *first divergence*: the 0-based chunk position of the first chunk that differs; where one
  answer is a prefix of the other, the position where the shorter ends.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from analysis.sql import from_where
from analysis.units import UNITS
from stats.clustered import ArmMoments, clustered_mean

COMPARED, FAILED, UNRECORDED = "compared", "failed", "unrecorded"
COMPARES = (
    "greedy answers (temperature 0) of the same requests, the variant's against the control's; "
    "identical = the same text; first divergence = the 0-based position of the first token chunk "
    "that differs (a prefix diverges where it ends)"
)
POSITION_UNIT_TOKENS = "token"  # every compared answer streamed one token per chunk
POSITION_UNIT_CHUNKS = "chunk"  # some chunk held several tokens (speculative decoding, a proxy)
NO_KL = "not measured: the replay did not ask the variants for log-probabilities"
# A pair's kind, first divergence and chunking as one number for sumMap: kind * 2^40 +
# (position + 1) * 2 + one token per chunk (positions stay far below 2^39).
KINDS = (COMPARED, FAILED, UNRECORDED)
_KIND_STEP = 1 << 40
_KEY_SQL = (
    f"toUInt64(indexOf(['{COMPARED}', '{FAILED}', '{UNRECORDED}'], kind) - 1) * {_KIND_STEP} "
    "+ toUInt64(position + 1) * 2 + token_chunks"
)


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
    # the first index where the common prefix differs, else where the shorter answer ends
    common = "least(length(c_fps), length(v_fps))"
    first = (
        f"arrayFirstIndex((a, b) -> a != b, arraySlice(c_fps, 1, {common}), arraySlice(v_fps, 1, {common}))"
    )
    sql = f"""
        SELECT {key} AS cluster,
               multiIf(NOT (c_ok AND v_ok), '{FAILED}', c_fp = 0 OR v_fp = 0, '{UNRECORDED}', '{COMPARED}') AS kind,
               toUInt8(kind = '{COMPARED}' AND c_fp = v_fp) AS identical,
               if(kind != '{COMPARED}' OR identical, -1,
                  if({first} > 0, toInt64({first}) - 1,
                     if(length(c_fps) != length(v_fps), toInt64({common}), -1))) AS position,
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
    """The lower q-quantile of a distribution given as sorted values and counts (rank ceil(q n))."""
    total = sum(counts)
    if not total:
        return None
    rank = max(1, int(np.ceil(q * total)))
    seen = 0
    for p, c in zip(positions, counts):
        seen += c
        if seen >= rank:
            return p
    return positions[-1]


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
