"""The report formatted as text for reading, shared by the page and the sla_report command: an
interval as "0.9876 [0.9812, 0.9921]", the page's first screen (``answer``), the per-user and
adjusted statistics (``unit_summary``), the anytime-valid intervals (``anytime_summary``) and the
latency percentiles (``percentile_summary``). The same numbers as rows, for the CSV export, are
dashboards.tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from statistics import NormalDist
from typing import Any

from analysis.answer_fidelity import identical_line, kl_line, kl_text, live_line
from analysis.definitions import METRIC_LABELS
from dashboards.tables import (
    ANYTIME_DIFFERENCES,
    ANYTIME_QUANTITIES,
    INFERENCE_REQUESTS,
    UNIT_DIFFERENCES,
    UNIT_MEANS,
)

# A clustered or adjusted anytime sequence that is null, or a bound it does not have yet.
NO_VALUE = "—"
MIRROR_UNITS_NOTE = (
    "mirror mode: every request went to every variant, so there are no user-clustered or adjusted "
    "differences (the arms share their users); the paired analysis (vs_control.paired) compares them"
)


def interval_text(iv: Mapping[str, Any] | None, fmt: str) -> str:
    """ "0.9876 [0.9812, 0.9921]" for the page and sla_report; an open side (a None bound) is
    "-inf" or "inf", no estimate is "-"."""
    if not iv or iv.get("estimate") is None:
        return "-"
    lo = "-inf" if iv["lo"] is None else format(iv["lo"], fmt)
    hi = "inf" if iv["hi"] is None else format(iv["hi"], fmt)
    return f"{format(iv['estimate'], fmt)} [{lo}, {hi}]"


def percent_text(x: float | None) -> str:
    """A share as a whole percent, "-" for None; a value that rounds to 0 is "0%", never "-0%"."""
    return "-" if x is None else f"{int(round(x * 100))}%"


def _unadjusted_of(adj: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The difference without covariates an adjusted entry carries, as an interval (normal, at
    the entry's conf); None when it carries none."""
    if not adj or adj.get("unadjusted") is None:
        return None
    se = adj.get("se_unadjusted")
    half = None if se is None else NormalDist().inv_cdf(0.5 + adj["conf"] / 2) * se
    u = adj["unadjusted"]
    return {
        "estimate": u,
        "lo": None if half is None else u - half,
        "hi": None if half is None else u + half,
        "p_value": None,
    }


def unit_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The per-user and adjusted statistics formatted for the page and sla_report: per variant
    its clustered means (with the design effect: how many requests are worth one independent
    one), per comparison the unadjusted and the adjusted difference side by side with the
    variance reduction and the covariates used."""
    info = report.get("inference") or {}
    variants, comparisons = [], []
    for e in report["variants"]:
        per = e.get("clustered")
        if per:
            att = per.get("attainment") or {}
            row = {
                "variant": e["key"],
                "users": att.get("clusters"),
                "effective_users": att.get("effective_clusters"),
                "design_effect": att.get("design_effect"),
                "notes": [],
            }
            for name, _label, fmt in UNIT_MEANS:
                row[name] = interval_text(per.get(name), fmt)
                note = (per.get(name) or {}).get("note")
                if note and note not in row["notes"]:
                    row["notes"].append(note)
            variants.append(row)
        vs = e.get("vs_control") or {}
        if not (vs.get("clustered") or vs.get("adjusted")):
            continue
        for name, label, fmt in UNIT_DIFFERENCES:
            plain = (vs.get("clustered") or {}).get(name)
            adj = (vs.get("adjusted") or {}).get(name)
            if not (plain or adj):
                continue
            used = (adj or {}).get("adjusted") or {}
            if plain is None:  # requests as units: the adjusted fit's own unadjusted difference
                plain = _unadjusted_of(adj)
            comparisons.append(
                {
                    "variant": e["key"],
                    "quantity": label,
                    "unadjusted": interval_text(plain, fmt) if plain else "-",
                    "adjusted": interval_text(adj, fmt) if adj else "-",
                    "variance_reduction": percent_text(used.get("variance_reduction")) if adj else "-",
                    "covariates": ", ".join(used.get("covariates", [])) or ("none varied" if adj else "-"),
                    "not_used": "; ".join(f"{k}: {v}" for k, v in (used.get("not_used") or {}).items()),
                }
            )
    return {"info": info, "variants": variants, "comparisons": comparisons}


def sequence_text(seq: Mapping[str, Any] | None, fmt: str) -> str:
    """A user-clustered or adjusted anytime sequence for the page and sla_report: "—" when it is
    null, "0.9876 [—, —]" before it has bounds (too few units yet); its note says why."""
    if not seq or seq.get("estimate") is None:
        return NO_VALUE
    if seq["lo"] is None and seq["hi"] is None:
        return f"{format(seq['estimate'], fmt)} [{NO_VALUE}, {NO_VALUE}]"
    return interval_text(seq, fmt)


def _sequence_notes(seqs: Iterable[tuple[str, Mapping[str, Any] | None]]) -> list[str]:
    """The notes of a row's sequences, each once: why a sequence has no bounds, or is null."""
    notes: list[str] = []
    for name, seq in seqs:
        note = (seq or {}).get("note")
        if seq is None and name.startswith("mean_ttft"):
            note = "mean TTFT: no successful request with a TTFT in an arm"
        if note and note not in notes:
            notes.append(note)
    return notes


def _adjusted_on(adj: Mapping[str, Any]) -> tuple[str, str]:
    """(the covariates the adjusted sequences are on, those left out and why): one list when
    every quantity used the same covariates, else per quantity."""
    used: dict[str, str] = {}
    left: list[str] = []
    for name, label, _fmt in UNIT_DIFFERENCES:
        seq = adj.get(name)
        if not seq:
            continue
        label_of = seq.get("adjusted") or {}
        used[label] = ", ".join(label_of.get("covariates", [])) or "none varied"
        left += [f"{k}: {why}" for k, why in (label_of.get("not_used") or {}).items()]
    distinct = set(used.values())
    text = distinct.pop() if len(distinct) == 1 else "; ".join(f"{k}: {v}" for k, v in used.items())
    return text, "; ".join(dict.fromkeys(left))


def anytime_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The anytime-valid intervals formatted for the page and sla_report, one row per variant
    and inference, as the fixed-horizon per-user tables label theirs: the request-level sequences
    (p99 TTFT), then the user-clustered ones (mean TTFT; per arm and the differences) and the
    adjusted differences (inference "user-clustered, adjusted" or "requests, adjusted"). A cell
    is "" where the inference has no such sequence (p99 is per request and not adjusted; the
    adjustment is of differences only), "-" where there is no comparison (the control, or
    clustered differences in mirror mode), "—" for a null sequence or bound, with the row's
    notes saying why. Also the table's notes: the unit sequences' design, and in mirror mode
    that they give no differences."""
    at = report.get("anytime") or {}
    blank = dict.fromkeys(
        [*ANYTIME_QUANTITIES, *ANYTIME_DIFFERENCES, "mean_ttft_ms", "mean_ttft_difference"], ""
    )
    rows: list[dict[str, Any]] = []
    clustered_rows = False
    for v, e in at.get("variants", {}).items():
        vs = e["vs_control"]
        rows.append(
            {
                **blank,
                "variant": v,
                "inference": INFERENCE_REQUESTS,
                "kind": "requests",
                "attainment": interval_text(e["attainment"], ".4f"),
                "error_rate": interval_text(e["error_rate"], ".4f"),
                "p99_ttft_ms": interval_text(e["p99_ttft_ms"], ".1f"),
                "attainment_difference": interval_text((vs or {}).get("attainment_difference"), "+.4f"),
                "error_rate_difference": interval_text((vs or {}).get("error_rate_difference"), "+.4f"),
                "p99_ttft_difference": interval_text((vs or {}).get("p99_ttft_difference"), "+.1f"),
                "has_arm": True,
                "has_difference": vs is not None,
                "adjusted_on": "",
                "not_used": "",
                "notes": [],
            }
        )
        per, diffs = e.get("clustered"), (vs or {}).get("clustered")
        if per or diffs:
            clustered_rows = True
            row = {
                **blank,
                "variant": v,
                "inference": (per or diffs)["inference"],
                "kind": "clustered",
                "has_arm": per is not None,
                "has_difference": diffs is not None,
                "adjusted_on": "",
                "not_used": "",
            }
            seqs = []
            for part, names in ((per, UNIT_MEANS), (diffs, UNIT_DIFFERENCES)):
                for name, _label, fmt in names:
                    row[name] = sequence_text(part.get(name), fmt) if part else "-"
                    seqs += [(name, part.get(name))] if part else []
            row["notes"] = _sequence_notes(seqs)
            rows.append(row)
        adj = (vs or {}).get("adjusted")
        if adj:
            on, left = _adjusted_on(adj)
            row = {
                **blank,
                "variant": v,
                "inference": f"{adj['inference']}, adjusted",
                "kind": "adjusted",
                "has_arm": False,
                "has_difference": True,
                "adjusted_on": on,
                "not_used": left,
            }
            for name, _label, fmt in UNIT_DIFFERENCES:
                row[name] = sequence_text(adj.get(name), fmt)
            row["notes"] = _sequence_notes((name, adj.get(name)) for name, _l, _f in UNIT_DIFFERENCES)
            rows.append(row)
    notes = []
    info = at.get("units") or {}
    if info.get("cluster_by_user") or info.get("adjust"):
        notes.append(info["note"])
    if clustered_rows and (report.get("modes") or {}).get("mirror"):
        notes.append(MIRROR_UNITS_NOTE)
    return {"rows": rows, "notes": notes}


# The verdict's third word (stats.verdict.NOT_ENOUGH): the page styles it as undecided.
VERDICT_CLASSES = {"meets": "meets", "misses": "misses"}


def points_text(iv: Mapping[str, Any] | None) -> str:
    """A difference of shares in percentage points: "+7.45 pp [+4.56, +10.34]"; "-" for none."""
    if not iv or iv.get("estimate") is None:
        return "-"
    return f"{iv['estimate'] * 100:+.2f} pp [{iv['lo'] * 100:+.2f}, {iv['hi'] * 100:+.2f}]"


def answer(report: Mapping[str, Any]) -> dict[str, Any]:
    """The page's first screen. Per variant: its verdict, attainment with the interval the verdict
    reads, its difference to the control with its interval, errors (and the 4xx setup errors when
    the report counts them: "setup_errors", read if present) and the verdict's own sentence; and
    the one sentence naming that inference (the fixed-horizon, request-level interval: the
    report's inference.request_level lists the verdict among the keys that treat requests as
    independent draws)."""
    rows = []
    conf = None
    for e in report["variants"]:
        a, v = e["attainment"], e["verdict"]
        conf = conf or (a or {}).get("conf")
        rows.append(
            {
                "variant": e["key"],
                "control": e["control"],
                "verdict": v["verdict"],
                "verdict_class": VERDICT_CLASSES.get(v["verdict"], "undecided"),
                "n_needed": v.get("n_needed"),
                "attainment": interval_text(a, ".2%"),
                "difference": points_text((e.get("vs_control") or {}).get("attainment_difference")),
                "n": e["n"],
                "errors": e["errors"],
                "setup_errors": _count(e.get("setup_errors")),
                "message": v["message"],
                "identical": identical_text(e.get("fidelity")) if not e["control"] else "reference",
            }
        )
    share = f"{conf:.0%}" if conf else "95%"
    inference = (
        f"Intervals: {share} fixed-horizon, requests as independent draws, the ones the verdict reads "
        f"(meets: the whole attainment interval at or above the target; misses: below it); read them "
        f"once the run is over."
    )
    fidelity = any(e.get("fidelity") for e in report["variants"])
    return {"rows": rows, "inference": inference, "fidelity": fidelity}


def identical_text(fid: Mapping[str, Any] | None) -> str:
    """The share of identical answers with its interval, "94.0% [92.1%, 95.5%]"; "-" where no
    pair was compared (no mirror replay, or none fingerprinted)."""
    if not fid or not fid.get("identical"):
        return "-"
    iv = fid["identical"]
    if iv["lo"] is None:
        return f"{iv['estimate']:.1%} (no interval)"
    return f"{iv['estimate']:.1%} [{iv['lo']:.1%}, {iv['hi']:.1%}]"


def fidelity_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """Answers against the control's, per variant compared (analysis.answer_fidelity): the
    identical share with its interval, how many were compared, how many parted and where (median
    and p90 of the first divergence), the pairs not compared and why; and what was compared."""
    rows = []
    notes: list[str] = []
    for e in report["variants"]:
        fid = e.get("fidelity")
        if not fid:
            continue
        pos = fid["first_divergence"]
        ident = fid.get("identical") or {}
        rows.append(
            {
                "variant": e["key"],
                "identical": identical_text(fid),
                "compared": fid["compared"],
                "clusters": ident.get("clusters"),
                "diverged": fid["diverged"],
                "where": "-"
                if pos["median"] is None
                else f"median {pos['unit']} {pos['median']}, p90 {pos['p90']}",
                "failed": fid["failed"],
                "unrecorded": fid["unrecorded"],
                "line": identical_line(e["key"], fid),
                "note": ident.get("note"),
                # the scoring pass's teacher-forced KL (analysis.answer_fidelity.kl_entry)
                "kl": kl_text(fid),
                "kl_line": kl_line(e["key"], fid),
                "pairs": fid["pairs"],
                # the gateway's live shadows (analysis.answer_fidelity.live_entry)
                "live_line": live_line(e["key"], fid),
            }
        )
        if fid["unrecorded"]:
            notes.append(
                f"{e['key']}: {fid['unrecorded']:,} answered pairs carry no fingerprint (samples written "
                "before fingerprints were kept, or not a mirror replay): not compared"
            )
    if not rows:
        return {
            "rows": [],
            "compares": None,
            "reference": None,
            "notes": [],
            "kl": None,
            "kl_measured": False,
        }
    first = next(e["fidelity"] for e in report["variants"] if e.get("fidelity"))
    return {
        "rows": rows,
        "reference": first["reference"],
        "compares": first["compares"],
        "notes": notes,
        "kl": first["kl_note"],
        # any variant's requests scored (each row's kl_line); otherwise "kl" says why none
        "kl_measured": any(r["kl_line"] for r in rows),
    }


def _count(entry: Any) -> int | None:
    """A count the report gives as a number or as {"n": ...} (variants[].setup_errors); None when
    it gives none."""
    if isinstance(entry, Mapping):
        entry = entry.get("n")
    return entry if isinstance(entry, int) else None


def percentile_summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The latency percentiles as one page table: per variant and metric a row, a column per
    quantile label ("p50", "p99", ...), each cell "value [lo, hi]" (exact order-statistic CI)."""
    labels: list[str] = []
    out = []
    for e in report["variants"]:
        for metric, ests in e["percentiles"].items():
            cells = {est["label"]: _estimate_text(est) for est in ests}
            labels += [lab for lab in cells if lab not in labels]
            out.append({"variant": e["key"], "metric": METRIC_LABELS.get(metric, metric), "cells": cells})
    for row in out:
        row["cells"] = [row["cells"].get(lab, "-") for lab in labels]
    return {"labels": labels, "rows": out}


def _estimate_text(est: Mapping[str, Any]) -> str:
    if est["value"] is None:
        return "-"
    if est["lo"] is None:
        return f"{est['value']:.1f} [n too small]"
    return f"{est['value']:.1f} [{est['lo']:.1f}, {est['hi']:.1f}]"
