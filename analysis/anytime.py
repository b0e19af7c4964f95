"""The report's anytime-valid intervals: the ones an analyst may read mid-run, as often as they like.

The rest of the report is fixed-horizon (Wilson, Newcombe, order-statistic CIs, the chi-square
SRM test): valid at one sample size chosen in advance, so read when a run is over. Read after
every batch they mislead (bench/RESULTS.md, "Anytime-valid guardrails": a candidate exactly at
its target is "breached" in 24.5% of A/A runs at alpha 5%). The confidence sequences of
stats.sequential hold at every look at once; here they are computed from the same totals and
order statistics the report already reads, so the two kinds sit side by side:

- per variant: attainment and error rate (beta-binomial mixture sequences), p99 TTFT of the
  successful requests (the quantile sequence from order statistics);
- per variant against the control: the attainment, error-rate and p99 TTFT differences (each
  arm's sequence at alpha/2, Bonferroni: valid whatever the dependence, so in mirror mode too);
- the split: the sequential SRM test (Dirichlet-multinomial e-value per config revision; the
  revisions' e-values multiply).

Those treat requests as independent draws. When the experiment's analysis clusters by user or
adjusts (analysis.units), the same per-unit moments the fixed-horizon clustered and adjusted
numbers come from give their anytime-valid counterparts (``unit_sequences``): the asymptotic
normal-mixture confidence sequences of stats.sequential.adjusted on

- per variant (clustered by user): attainment, error rate and mean TTFT per request, each
  arm's ratio mean with its user-clustered variance;
- per variant against the control: the attainment, error-rate and mean TTFT differences,
  user-clustered (cluster_by_user), and regression-adjusted on the pre-request covariates that
  vary (adjust; on the same covariates as the fixed-horizon adjusted differences), with users or
  requests as the unit as those are (their ``inference``). Not in mirror mode (the arms share
  their users: the fixed-horizon paired analysis is the one for it).

Each such sequence is one sequence at ``alpha`` (a difference is one sequence on the difference,
not two arms' at alpha/2), narrowest at TARGET_N requests and without bounds until every arm
read has MIN_CLUSTERS units; a share's bounds are clipped to its range (the truth lies in it, so
that costs no coverage).

These are the statistics the rollout controller decides on (rollouts/controller.py), so what the
dashboard shows mid-rollout is what the controller saw. Pure: no Django, no store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis import units
from stats.clustered import ArmMoments
from stats.sequential._base import SequentialInterval
from stats.sequential.adjusted import (
    DEFAULT_MIN_CLUSTERS,
    DEFAULT_TARGET_N,
    adjusted_difference_look,
    clustered_difference_sequence,
    clustered_mean_sequence,
)
from stats.sequential.means import MeanSequence, difference_interval
from stats.sequential.quantiles import (
    quantile_cs_ranks,
    quantile_difference_interval,
    quantile_interval_from_order_stats,
)
from stats.sequential.srm import SrmSequence

P99 = 0.99
NOTE = (
    "anytime-valid (confidence sequences): may be read mid-run, after every batch, as often as "
    "you like; wider than the fixed-horizon intervals, which hold only when read once, at the end"
)


# The unit sequences' design, fixed before the data (stats.sequential.adjusted): narrowest at
# TARGET_N requests (of both arms for a difference, of the arm for its mean); no bounds before
# MIN_CLUSTERS units in every arm read.
TARGET_N = DEFAULT_TARGET_N
MIN_CLUSTERS = DEFAULT_MIN_CLUSTERS
UNITS_NOTE = (
    "user-clustered and adjusted: asymptotic normal-mixture confidence sequences on the same "
    "estimates as inference, vs_control.clustered and vs_control.adjusted (stats.sequential."
    f"adjusted), each at alpha; narrowest at {TARGET_N} requests; no bounds before {MIN_CLUSTERS} "
    "units in every arm read"
)


def p99_ranks(n: int, alpha: float) -> set[int]:
    """Ranks (1..n) of the order statistics the p99 sequences need at ``n`` samples: per arm at
    alpha, and at alpha/2 for the difference to the control."""
    out: set[int] = set()
    if n <= 0:
        return out
    for a in (alpha, alpha / 2.0):
        lo, hi = quantile_cs_ranks(np.array([n], dtype=np.int64), P99, a)
        out.update(r for r in (int(lo[0]), int(hi[0])) if 1 <= r <= n)
    return out


def _share(hits: int, n: int, alpha: float) -> MeanSequence:
    return MeanSequence(n=int(n), hits=int(hits), alpha=alpha)


def _p99(n: int, by_rank: Mapping[int, float], alpha: float) -> Any:
    return quantile_interval_from_order_stats(int(n), P99, dict(by_rank), alpha)


def anytime_intervals(
    summ: Mapping[str, Mapping[str, Any]],
    order: Sequence[str],
    control: str,
    ttft_order_stats: Mapping[str, Mapping[int, float]],
    alpha: float,
) -> dict[str, Any]:
    """Per variant in ``order``: its sequences and, but for the control, the differences.

    ``summ``: the readers' summary (n, hits, errors, metric_n per variant); ``ttft_order_stats``:
    variant -> rank -> TTFT of the successful requests, holding at least ``p99_ranks``."""
    out: dict[str, Any] = {}
    arms: dict[str, tuple[MeanSequence, MeanSequence, int]] = {}
    for v in order:
        s = summ.get(v)
        n = int(s["n"]) if s else 0
        if not n:
            out[v] = {"n": 0, "attainment": None, "error_rate": None, "p99_ttft_ms": None, "vs_control": None}
            continue
        att, err = _share(s["hits"], n, alpha), _share(s["errors"], n, alpha)
        n_ttft = int(s["metric_n"]["ttft_ms"])
        arms[v] = (att, err, n_ttft)
        out[v] = {
            "n": n,
            "attainment": att.interval().as_dict(),
            "error_rate": err.interval().as_dict(),
            "p99_ttft_ms": _p99(n_ttft, ttft_order_stats.get(v, {}), alpha).as_dict() if n_ttft else None,
            "vs_control": None,
        }
    if control not in arms:
        return out
    c_att, c_err, c_n = arms[control]
    for v, (att, err, n_ttft) in arms.items():
        if v == control:
            continue
        p99_diff = None
        if n_ttft and c_n:
            half = alpha / 2.0
            p99_diff = quantile_difference_interval(
                _p99(c_n, ttft_order_stats.get(control, {}), half),
                _p99(n_ttft, ttft_order_stats.get(v, {}), half),
            ).as_dict()
        out[v]["vs_control"] = {
            "attainment_difference": difference_interval(c_att, att, alpha).as_dict(),
            "error_rate_difference": difference_interval(c_err, err, alpha).as_dict(),
            "p99_ttft_difference": p99_diff,
        }
    return out


def anytime_srm(
    parts: Sequence[tuple[str, Mapping[str, int], Mapping[str, float]]], alpha: float
) -> dict[str, Any]:
    """The sequential SRM test over (revision, distinct users per variant, weights) parts.

    Each revision is its own e-process (its own weights); under a correct split their product is
    still one, so the test flags when the product reaches 1/alpha. It reads the totals now: the
    p-value is 1/E at this look, valid at any look (smaller, never larger, at a peak between
    looks the report did not see)."""
    log_e = 0.0
    per: list[dict[str, Any]] = []
    for rev, counts, weights in parts:
        if not weights or sum(weights.values()) <= 0:
            continue
        seq = SrmSequence(weights=dict(weights), alpha=alpha).update(
            {k: int(c) for k, c in counts.items() if k in weights}
        )
        chk = seq.check()
        log_e += math.inf if chk.log_e_value is None else chk.log_e_value
        per.append(
            {"revision": rev, "counts": chk.counts, "log_e_value": chk.log_e_value, "flagged": chk.flagged}
        )
    p = 0.0 if math.isinf(log_e) else min(1.0, math.exp(-log_e))
    flagged = bool(per) and p <= alpha
    return {
        "applicable": bool(per),
        "log_e_value": None if math.isinf(log_e) else log_e,
        "p_value": p,
        "alpha": alpha,
        "flagged": flagged,
        "revisions": per,
        "message": (
            f"Sample ratio mismatch, anytime-valid (p={p:.2g} <= {alpha}): the users do not follow "
            "the weights; the split is broken"
            if flagged
            else ""
        ),
    }


def _bounded(iv: SequentialInterval, binary: bool, low: float) -> dict[str, Any]:
    """The sequence as the report shows it: a share's bounds clipped to [low, 1]; a note when
    there are no bounds yet."""
    out = iv.as_dict()
    if binary:
        for side in ("lo", "hi"):
            if out[side] is not None:
                out[side] = min(max(out[side], low), 1.0)
    out["note"] = None
    if iv.estimate is not None and iv.lo is None and iv.hi is None:
        out["note"] = f"fewer than {MIN_CLUSTERS} units in an arm: no bounds yet"
    return out


def _difference(c: ArmMoments, v: ArmMoments, alpha: float) -> dict[str, Any]:
    iv = clustered_difference_sequence(c, v, alpha, TARGET_N, MIN_CLUSTERS)
    return {"inference": units.INFERENCE_USER, **_bounded(iv, c.binary, -1.0)}


def _adjusted(c: ArmMoments, v: ArmMoments, inference: str, alpha: float) -> dict[str, Any]:
    """The adjusted difference's sequence on the covariates the fixed-horizon one uses
    (units.fit_on_varying), labelled as it is."""
    look, used, left, error = units.fit_on_varying(
        c, v, lambda a, b: adjusted_difference_look(a, b, alpha, TARGET_N, MIN_CLUSTERS)
    )
    if look is None:
        label = {"covariates": [], "variance_reduction": None, "not_used": left}
        empty = {"estimate": None, "lo": None, "hi": None, "alpha": alpha, "method": ""}
        return {"inference": inference, "adjusted": label, **empty, "note": error}
    label = {"covariates": list(used), "variance_reduction": look.variance_reduction, "not_used": left}
    return {"inference": inference, "adjusted": label, **_bounded(look.interval, c.binary, -1.0)}


def unit_sequences(
    moments: Mapping[str, units.UnitMoments] | None,
    order: Sequence[str],
    control: str,
    modes: Mapping[str, int],
    cluster_by_user: bool,
    adjust: bool,
    alpha: float,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the anytime key's "units" description, {variant: {"clustered": ..., "vs_control":
    {"clustered": ..., "adjusted": ...} or None}}) from the report's per-unit moments
    (analysis.units; None when the analysis is off). Keys as the fixed-horizon ones: None when
    off, in mirror mode (differences) or without the arm's moments."""
    info = {
        "unit": "user" if cluster_by_user else "request",
        "cluster_by_user": cluster_by_user,
        "adjust": adjust,
        "target_n": TARGET_N,
        "min_clusters": MIN_CLUSTERS,
        "note": UNITS_NOTE if (cluster_by_user or adjust) else "off for this experiment",
    }
    moments = moments or {}
    out: dict[str, dict[str, Any]] = {v: {"clustered": None, "vs_control": None} for v in order}
    if cluster_by_user:
        for v in order:
            um = moments.get(v)
            if um is None:
                continue
            entry: dict[str, Any] = {"inference": units.INFERENCE_USER}
            for metric, m in units.METRICS.items():
                arm = um.arm(metric)
                if arm is None:
                    entry[metric] = None
                    continue
                iv = clustered_mean_sequence(arm, alpha, TARGET_N, MIN_CLUSTERS)
                entry[metric] = {"inference": units.INFERENCE_USER, **_bounded(iv, m.binary, 0.0)}
            out[v]["clustered"] = entry
    if control not in moments or modes.get("mirror") or not (cluster_by_user or adjust):
        return info, out
    inference = units.INFERENCE_USER if cluster_by_user else units.INFERENCE_REQUEST
    full = list(units.COVARIATES)
    for v in order:
        if v == control or v not in moments:
            continue
        comp: dict[str, Any] = {
            "clustered": {"inference": units.INFERENCE_USER} if cluster_by_user else None,
            "adjusted": {"inference": inference, "note": units.NOT_ADJUSTED} if adjust else None,
        }
        for metric, name in units.DIFFERENCES.items():
            c_arm, v_arm = moments[control].arm(metric), moments[v].arm(metric)
            if c_arm is None or v_arm is None:
                for part in comp.values():
                    if part is not None:
                        part[name] = None
                continue
            if cluster_by_user:
                comp["clustered"][name] = _difference(c_arm, v_arm, alpha)
            if adjust:
                c_full, v_full = moments[control].arm(metric, full), moments[v].arm(metric, full)
                assert c_full is not None and v_full is not None
                comp["adjusted"][name] = _adjusted(c_full, v_full, inference, alpha)
        out[v]["vs_control"] = comp
    return info, out
