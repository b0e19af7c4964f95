"""python manage.py sla_report KEY [--run ID] [--since T] [--until T] [--variant V ...]
[--status S ...] [--mode split|mirror] [--json] [--csv DIR]

By default the report reads completed runs of one mode (the latest completed run's); --status
reads runs of other catalog statuses too (running, cancelled, failed, or all), labelled, and
--mode picks the mode. An unknown --run is an error naming the experiment's runs.

Default output is a readable table. --json prints the report dict, the stable shape documented
in docs/report-json.md (the same JSON as GET /api/experiments/KEY/report):

    {"schema_version": 2, "experiment": {"key", "name", "control", "sla": {...}},
     "filters": {...}, "window": {...}, "runs": {...}, "banners": [str], "srm": {...},
     "variants": [{"key", "control", "n", "errors", "error_rate", "hits",
                   "attainment": {"estimate", "lo", "hi", "conf"}, "goodput_rps",
                   "verdict": {...}, "percentiles": {metric: [{"q", "label", "n", "value",
                   "lo", "hi", "coverage", "note"}]}, "itl": {"gaps", "requests",
                   "requests_without_gaps", "unrecorded", "note"}, "clustered": {...} | null,
                   "vs_control": {..., "clustered": {...} | null, "adjusted": {...} | null} | null}],
     "inference": {"unit", "cluster_by_user", "adjust", "covariates", "note", ...},
     "attribution": {...}, "phases": {...}, "segments": {...}, "mix_rate": {...},
     "timeseries": {...}, "cdf": {...}, "timing": {"query_s"}}

--csv DIR writes one CSV per table (dashboards.tables.TABLES) into DIR. With --json a refusal
(an unknown experiment or run, a bad filter, a report past its time limit) exits 1 with
{"error": {"message", "field", "errors"}} (experiments.cli), field naming the option.
"""

from __future__ import annotations

import re
from pathlib import Path

from analysis.definitions import METRIC_LABELS, MODES, QueryError
from dashboards import summaries, tables
from dashboards.reports import report_for_params, report_time_limit_s, timeout_message
from experiments.cli import CliError, JsonCommand, add_json_argument, experiment_named
from samples.store import QueryTimeout

# A QueryError that starts "run=..." is about --run (dashboards.filters words them for the URL).
_OPTION = re.compile(r"^(run|status|variant|mode|since|until)=")


class Command(JsonCommand):
    help = "SLA report of an experiment: a table, --json, or --csv DIR"

    def add_arguments(self, parser):
        parser.add_argument("key")
        parser.add_argument("--run", help="only this run id")
        parser.add_argument("--since", help="ISO date-time (UTC when no zone), inclusive")
        parser.add_argument("--until", help="ISO date-time (UTC when no zone), exclusive")
        parser.add_argument("--variant", action="append", default=[], help="repeatable")
        parser.add_argument(
            "--status",
            action="append",
            default=[],
            help="run statuses to read besides the default (done): running, done, cancelled, failed, "
            "or all; repeatable or comma-separated",
        )
        parser.add_argument(
            "--mode", choices=MODES, help="read runs of this mode (live: the gateway's real traffic)"
        )
        add_json_argument(parser)
        parser.add_argument("--csv", metavar="DIR", help="write one CSV per table into DIR")

    def handle(self, *args, **opts):
        experiment = experiment_named(opts["key"])
        params = {k: opts[k] or "" for k in ("since", "until", "mode")} | {"run": opts["run"] or ""}
        try:
            _filters, report = report_for_params(experiment, params, opts["variant"], opts["status"])
        except QueryError as e:
            option = _OPTION.match(str(e))
            raise CliError(str(e), field=f"--{option.group(1)}" if option else None) from None
        except QueryTimeout:
            raise CliError(timeout_message(report_time_limit_s())) from None
        if opts["csv"]:
            out = Path(opts["csv"])
            out.mkdir(parents=True, exist_ok=True)
            for table in tables.TABLES:
                with open(out / f"{table}.csv", "w", newline="") as f:
                    tables.write_csv(f, report, table)
        if self.json:
            self.emit(report)
            return
        self.stdout.write(render_text(report))


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


SLO_LABELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end"))


def slo_text(sla) -> str:
    """Every SLO a request must meet, e.g. "TTFT < 200 ms, TPOT < 50 ms" (attainment applies
    them all)."""
    return ", ".join(f"{label} < {sla[k]:g} ms" for k, label in SLO_LABELS if sla.get(k) is not None)


def anytime_lines(report) -> list[str]:
    """The anytime-valid intervals, labelled as the ones that may be read mid-run: per variant a
    line per inference (requests, then user-clustered), then its differences to the control per
    inference (and adjusted, with its covariates), as the per-user block labels its columns; a
    null clustered or adjusted sequence or bound is "—", with the note saying why below."""
    at = report.get("anytime")
    if not at:
        return []
    lines = [
        "",
        f"Anytime-valid intervals (alpha {at['alpha']:g}; {at['note']}); the CIs above are "
        "fixed-horizon: read them when the run is over:",
        f"  {'variant':<14}{'inference':<28}{'attainment':<28}{'error rate':<28}TTFT ms",
    ]
    summary = summaries.anytime_summary(report)
    by_variant: dict[str, list[dict]] = {}
    for r in summary["rows"]:
        by_variant.setdefault(r["variant"], []).append(r)
    for v, rows in by_variant.items():
        arms = [_anytime_line(r, "") for r in rows if r["has_arm"]]
        diffs = [_anytime_line(r, "_difference") for r in rows if r["has_difference"]]
        lines += [f"  {v if i == 0 else '':<14}{line}" for i, line in enumerate(arms)]
        lines += [f"  {'Δ vs control' if i == 0 else '':<14}{line}" for i, line in enumerate(diffs)]
        notes = dict.fromkeys(note for r in rows for note in r["notes"])
        lines += [f"  {'':<14}{note}" for note in notes]
    lines += [f"  {note}" for note in summary["notes"]]
    srm = at.get("srm") or {}
    if srm.get("applicable"):
        verdict = srm["message"] if srm["flagged"] else "no mismatch"
        lines.append(f"  split (sequential SRM): anytime p={srm['p_value']:.3g}: {verdict}")
    return lines


def _anytime_line(row, suffix: str) -> str:
    """One anytime row's sequences of a variant (suffix "") or of its differences to the control
    ("_difference"): TTFT is the p99 for requests, the mean for the user-clustered and adjusted."""
    ttft = (
        f"p99 {row['p99_ttft' + (suffix or '_ms')]}"
        if row["kind"] == "requests"
        else f"mean {row['mean_ttft' + (suffix or '_ms')]}"
    )
    if row["adjusted_on"]:
        ttft += f" (on {row['adjusted_on']})"
    return f"{row['inference']:<28}{row['attainment' + suffix]:<28}{row['error_rate' + suffix]:<28}{ttft}"


def unit_lines(report) -> list[str]:
    """The statistics at the unit of randomization: per-user intervals, and the unadjusted and
    covariate-adjusted differences side by side with the variance reduction (or that the
    experiment turned them off)."""
    summary = summaries.unit_summary(report)
    info = summary["info"]
    if not info:
        return []
    lines = ["", f"Per user, the unit of randomization ({info['note']}):"]
    if not info["cluster_by_user"] and not info["adjust"]:
        return lines
    for r in summary["variants"]:
        effect = "-" if r["design_effect"] is None else f"{r['design_effect']:.2f}"
        lines.append(
            f"  {r['variant']:<12}attainment {r['attainment']}  error rate {r['error_rate']}  "
            f"mean TTFT ms {r['mean_ttft_ms']}  users {r['users']} ({r['effective_users']:.0f} effective), "
            f"design effect {effect}"
        )
        lines += [f"  {'':<12}{note}" for note in r["notes"]]
    if summary["comparisons"]:
        lines.append(
            f"  {'vs control':<12}{'':<14}{'unadjusted [95% CI]':<30}{'adjusted [95% CI]':<30}variance reduction"
        )
        for c in summary["comparisons"]:
            used = f" (on {c['covariates']})" if c["adjusted"] != "-" else ""
            lines.append(
                f"  {c['variant']:<12}{c['quantity']:<14}{c['unadjusted']:<30}{c['adjusted']:<30}"
                f"{c['variance_reduction']}{used}"
            )
        lines.append(f"  {info['not_adjusted']}")
    return lines


def itl_lines(report) -> list[str]:
    """What the pooled ITL holds per variant: gaps, requests, and the successful requests without
    gaps (one token, or recorded before the samples kept gaps: a count, never a crash)."""
    entries = [(e["key"], e["itl"]) for e in report["variants"] if e.get("itl")]
    if not entries:
        return []
    lines = ["", f"ITL (all gaps): {entries[0][1]['note']}. TPOT stays one value per request."]
    for v, itl in entries:
        line = f"  {v:<12}{itl['gaps']:,} gaps from {itl['requests']:,} requests"
        if itl["requests_without_gaps"]:
            line += f"; {itl['requests_without_gaps']:,} successful requests without gaps"
            if itl["unrecorded"]:
                line += f" ({itl['unrecorded']:,} recorded before gaps were stored)"
        lines.append(line)
    return lines


def fidelity_lines(report) -> list[str]:
    """Answers against the control's in mirror replays: the identical share per variant with its
    interval, where the others part, and what was not compared; then each variant's teacher-forced
    KL from the control where its requests were scored."""
    summary = summaries.fidelity_summary(report)
    if not summary["rows"]:
        return []
    lines = ["", f"Answers against {summary['reference']} ({summary['compares']}):"]
    for r in summary["rows"]:
        if not r["pairs"]:  # live answers alone (below)
            continue
        line = f"  {r['variant']:<12}identical {r['identical']:<26}of {r['compared']:,} compared"
        if r["clusters"]:
            line += f" ({r['clusters']:,} clusters)"
        line += f"; {r['diverged']:,} diverged ({r['where']})"
        if r["failed"]:
            line += f"; {r['failed']:,} not compared (either side failed)"
        lines.append(line)
        if r["note"]:
            lines.append(f"  {'':<12}{r['note']}")
    lines += [f"  {note}" for note in summary["notes"]]
    for e in report["variants"]:
        for ex in (e.get("fidelity") or {}).get("examples", []):
            lines.append(example_line(e["key"], summary["reference"], ex))
    if summary["kl_measured"]:  # teacher-forced KL from the scoring pass, per variant scored
        lines += [f"  {r['kl_line']}" for r in summary["rows"] if r["kl_line"]]
        lines += [f"  {r['variant']}: KL not measured" for r in summary["rows"] if not r["kl_line"]]
    elif any(r["pairs"] for r in summary["rows"]):
        lines.append(f"  KL divergence: {summary['kl']}")
    lines += [f"  {r['live_line']}" for r in summary["rows"] if r["live_line"]]
    return lines


EXAMPLE_CHARS = 40  # of each text shown from the first character that differs


def example_line(variant: str, reference: str, ex) -> str:
    """One stored diverged pair as a line: where it parts, and each text from the first
    character that differs (the report keeps more around it)."""
    where = f"token {ex['position']}" if ex["position"] is not None else f"character {ex['char']}"
    cut = ex["char"] - ex["start"]

    def text(side) -> str:
        return repr(side["text"][cut : cut + EXAMPLE_CHARS])

    return (
        f"  {variant:<12}run {ex['run_id']} request {ex['seq']} parts at {where}: "
        f"{reference} {text(ex['control'])}, {variant} {text(ex['variant'])}"
    )


def run_status(run, mode: str | None) -> str:
    """A run as the report lists it: its catalog status, "live" for the gateway's runs."""
    if (run.get("mode") or mode) != "live":
        return run["status"]
    return "live" if run["status"] == "uncatalogued" else f"live, {run['status']}"


def render_text(report) -> str:
    exp = report["experiment"]
    sla = exp["sla"]
    runs = report.get("runs") or {}
    read = (
        ", ".join(
            r.get("label") or f"{r['run_id']} ({run_status(r, runs.get('mode'))})"
            for r in runs.get("read", [])
        )
        or "none"
    )
    lines = [
        f"{exp['name']} ({exp['key']}): {slo_text(sla)} for {sla['target']:.2%}"
        f" of requests; control {exp['control']}",
        f"runs read: {read}; mode {runs.get('mode') or '-'} ({runs.get('mode_source', '-')})",
    ]
    lines += [f"   {note}" for note in runs.get("notes", [])]
    lines += [f"!! {b}" for b in report["banners"]]
    head = f"{'variant':<14}{'n':>9}{'errors':>8}{'attainment [95% CI]':>28}{'p99 TTFT ms':>14}"
    head += f"{'Δ vs control (p Holm)':>28}  verdict"
    lines += ["", head, "-" * len(head)]
    for e in report["variants"]:
        a = e["attainment"]
        att = f"{a['estimate']:.4f} [{a['lo']:.4f}, {a['hi']:.4f}]" if a else "-"
        p99 = next(x for x in e["percentiles"]["ttft_ms"] if x["label"] == "p99")["value"]
        vs = e["vs_control"]
        comp = (
            f"{vs['attainment_difference']['estimate']:+.4f} ({vs['attainment_p_holm']:.3g})" if vs else "-"
        )
        verdict = e["verdict"]["verdict"]
        if e["verdict"]["n_needed"]:
            verdict += f" (need ~{e['verdict']['n_needed']})"
        lines.append(
            f"{e['key']:<14}{e['n']:>9}{e['errors']:>8}{att:>28}{_f(p99, '.1f'):>14}{comp:>28}  {verdict}"
        )
    failed = [(e["key"], o, f) for e in report["variants"] for o, f in sorted(e.get("failures", {}).items())]
    if failed:
        lines += ["", "Failures by error class:"]
        lines += [
            f"  {v:<12}{o:<20}{f['n']:>8}  HTTP {f['http_status']}  {f['example'][:80]}" for v, o, f in failed
        ]
    lines += fidelity_lines(report)
    lines += ["", "Percentiles (ms, [95% CI]) of successful requests (ITL: of their inter-token gaps):"]
    for e in report["variants"]:
        for metric, ests in e["percentiles"].items():
            cells = "  ".join(
                f"{x['label']} {_f(x['value'], '.1f')} [{_f(x['lo'], '.1f')}, {_f(x['hi'], '.1f')}]"
                for x in ests
            )
            lines.append(f"  {e['key']:<12}{METRIC_LABELS.get(metric, metric):<16}{cells}")
    lines += unit_lines(report)
    lines += itl_lines(report)
    lines += anytime_lines(report)
    for metric in ("attainment", "p99_ttft_ms"):
        for v, entry in report["attribution"].get(metric, {}).items():
            lines.append(f"Why {v} ({metric}): {entry['text']}")
    return "\n".join(lines)
