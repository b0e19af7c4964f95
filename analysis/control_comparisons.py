"""Each variant against the control, as the SLA report gives it: the fixed-horizon tests of its
"vs_control" (attainment difference, p99 TTFT difference, Mann-Whitney on TTFT, paired tests in
mirror mode; Holm-adjusted across variants) and the factor attribution of the differences
(the report's "attribution" key, docs/report-json.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis import factors
from analysis.definitions import MW_SCALE
from analysis.experiment_info import ExperimentInfo
from stats.comparisons import (
    ArmCounts,
    compare_attainment,
    holm_adjust,
    mann_whitney_from_counts,
    quantile_difference_conf,
    quantile_difference_from_order_stats,
)
from stats.paired import mcnemar_attainment, wilcoxon_paired

P99 = 0.99


def compare_with_control(
    exp: ExperimentInfo,
    summ: Mapping[str, Mapping[str, Any]],
    present: Sequence[str],
    estimate: Any,
    counts: Mapping[str, tuple[list[float], list[int]]],
    pairs_by_variant: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, Any]]:
    control = exp.control
    others = [v for v in present if v != control]
    if control not in present or summ[control]["n"] == 0 or not others:
        return {}
    arms = {v: ArmCounts(summ[v]["n"], summ[v]["hits"]) for v in others if summ[v]["n"]}
    att = compare_attainment(ArmCounts(summ[control]["n"], summ[control]["hits"]), arms)
    arm_conf = quantile_difference_conf()
    out: dict[str, dict[str, Any]] = {}
    for v in arms:
        comp: dict[str, Any] = {
            "attainment_difference": att[v]["difference"],
            "attainment_p_holm": att[v]["p_holm"],
            "p99_ttft_difference": None,
            "mann_whitney_ttft": None,
            "paired": None,
            # per user and covariate-adjusted (analysis.units); None when off or in mirror mode
            "clustered": None,
            "adjusted": None,
        }
        if summ[v]["metric_n"]["ttft_ms"] and summ[control]["metric_n"]["ttft_ms"]:
            diff = quantile_difference_from_order_stats(
                estimate(control, "ttft_ms", P99, arm_conf), estimate(v, "ttft_ms", P99, arm_conf)
            )
            comp["p99_ttft_difference"] = diff.as_dict()
        if v in counts and control in counts:
            cv, cc = dict(zip(*counts[control], strict=True)), dict(zip(*counts[v], strict=True))
            values = sorted(set(cv) | set(cc))
            rt = mann_whitney_from_counts(
                values, [cv.get(x, 0) for x in values], [cc.get(x, 0) for x in values]
            )
            comp["mann_whitney_ttft"] = {
                **rt.as_dict(),
                "resolution_ms": 1.0 / MW_SCALE,
            }
        out[v] = comp
    # Mann-Whitney p-values are Holm-adjusted across variants too
    mw = {v: c["mann_whitney_ttft"]["p_value"] for v, c in out.items() if c["mann_whitney_ttft"]}
    for v, p in holm_adjust(mw).items() if mw else ():
        out[v]["mann_whitney_ttft"]["p_holm"] = p

    # mirror mode: the same requests went to every variant, so pair them
    if pairs_by_variant:
        paired_p: dict[str, float] = {}
        for v in out:
            pairs = pairs_by_variant[v]
            c = pairs["cells"]
            if not sum(c.values()):
                continue
            pa = mcnemar_attainment(c["both_hit"], c["control_only"], c["variant_only"], c["both_miss"])
            # explicit dtypes: with no pair where both arms succeeded the lists are empty, and
            # np.asarray([]) is float64, which np.repeat refuses as counts
            diffs = np.repeat(
                np.asarray(pairs["diff_values"], dtype=np.float64),
                np.asarray(pairs["diff_counts"], dtype=np.int64),
            )
            wx = wilcoxon_paired(diffs).as_dict() if diffs.size else None
            out[v]["paired"] = {"attainment": pa.as_dict(), "wilcoxon_ttft": wx}
            if pa.difference.p_value is not None:
                paired_p[v] = pa.difference.p_value
        for v, p in holm_adjust(paired_p).items() if paired_p else ():
            out[v]["paired"]["attainment_p_holm"] = p
    return out


def attribution(
    exp: ExperimentInfo, by_key: Mapping[str, Mapping[str, Any]], present: Sequence[str]
) -> dict[str, Any]:
    control = exp.control
    out: dict[str, Any] = {"attainment": {}, "p99_ttft_ms": {}, "note": ""}
    live = [v for v in present if by_key[v]["n"] > 0]
    if control not in live or len(live) < 2:
        out["note"] = "needs the control and at least one other variant with samples"
        return out
    if not any(by_key[v]["factors"] for v in live):
        out["note"] = "variants carry no factor tags"
        return out

    def p99(v: str) -> float | None:
        return next(e["value"] for e in by_key[v]["percentiles"]["ttft_ms"] if e["q"] == P99)

    metrics = {
        "attainment": ({v: by_key[v]["attainment"]["estimate"] for v in live}, True),
        "p99_ttft_ms": ({v: p99(v) for v in live}, False),
    }
    for name, (values, higher_is_better) in metrics.items():
        cells = {
            v: factors.Cell(dict(by_key[v]["factors"]), float(values[v]), float(by_key[v]["n"]))
            for v in live
            if values[v] is not None
        }
        try:
            result = factors.attribute_factors(cells, control)
        except ValueError as e:
            out["note"] = str(e)
            continue
        for v, entry in result.items():
            entry["text"] = factors.render_attribution(entry, higher_is_better=higher_is_better)
            out[name][v] = entry
    return out
