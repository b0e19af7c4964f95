"""Plotly figures for the dashboard, built from the report dict only (no queries here).

Each chart is {"id", "section", "title", "figure"} or, where the report has nothing to draw,
{"id", "section", "title", "empty"}: a sentence saying why (mirror mode has no traffic split,
no request missed the SLA, ...), which the page shows in the chart's place. The page writes the
title above the chart as HTML (it wraps at any width; a plotly title does not, and collides with
rotated axis titles), so the figures carry none. A figure is plain JSON (data + layout) for
Plotly.newPlot; the "none" template keeps each a few kB instead of carrying plotly's 10 kB theme.

Sections, in page order: "answer" (the verdicts' intervals, drawn), "why" (one chart per
question about the misses), "latency" (how TTFT and traffic looked).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.definitions import PHASE_LABELS, PHASES

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
PHASE_COLORS = ("#bbbbbb", "#9467bd", "#8c564b", "#ff7f0e", "#1f77b4", "#17becf")  # in PHASES order
VERDICT_COLORS = {"meets": "#1b7e1b", "misses": "#b00020"}
UNDECIDED_COLOR = "#a05a00"  # the report's third verdict, "not enough data"
GAIN, LOSS, TOTAL = "#2ca02c", "#d62728", "#555555"
_LAYOUT = dict(
    template="none",
    margin=dict(l=60, r=20, t=40, b=50),
    height=340,
    font=dict(family="system-ui, sans-serif", size=12),
    legend=dict(orientation="h", y=-0.2),
)
# Figures whose title is on the page: room above the plot for annotations (the SLA line's) only.
_UNTITLED_MARGIN = dict(l=64, r=24, t=28, b=50)
_TOP_LEGEND = dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom")
# A figure, or the sentence saying why there is none.
Drawn = dict[str, Any] | str


def series_color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def verdict_color(verdict: str) -> str:
    return VERDICT_COLORS.get(verdict, UNDECIDED_COLOR)


def finish_figure(fig: go.Figure, title: str | None) -> dict[str, Any]:
    """The figure as JSON with the house layout; title None: the page titles it (no plotly
    title, a smaller top margin)."""
    layout = {k: v for k, v in _LAYOUT.items() if k != "height" or fig.layout.height is None}
    if title is None:
        layout["margin"] = {**_UNTITLED_MARGIN, **fig.layout.margin.to_plotly_json()}
        # the legend above the plot: below it, it ran into the x axis' title
        layout["legend"] = {**_TOP_LEGEND, **fig.layout.legend.to_plotly_json()}
        fig.update_layout(**layout)
    else:
        fig.update_layout(title=dict(text=title, x=0, font=dict(size=14)), **layout)
    return json.loads(fig.to_json())


def _pp(x: float) -> str:
    return f"{x * 100:+.2f} pp"


# ---- the answer ---------------------------------------------------------------------------


def forest(report: Mapping[str, Any]) -> Drawn:
    """One row per variant: its attainment with the interval the verdict reads, the target's
    line; beside it, its difference to the control with its interval and a line at 0."""
    rows = [e for e in report["variants"] if e["attainment"]]
    if not rows:
        return "No variant has a sample in this selection: there is no attainment to draw."
    control = report["experiment"]["control"]
    target = report["experiment"]["sla"]["target"]
    labels = [f"{e['key']}{' (control)' if e['control'] else ''}: {e['verdict']['verdict']}" for e in rows]
    colors = [verdict_color(e["verdict"]["verdict"]) for e in rows]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06)
    att = [e["attainment"] for e in rows]
    fig.add_trace(
        go.Scatter(
            x=[a["estimate"] * 100 for a in att],
            y=labels,
            mode="markers",
            name="attainment",
            marker=dict(color=colors, size=11, symbol="square"),
            error_x=dict(
                type="data",
                symmetric=False,
                thickness=2,
                width=6,
                array=[(a["hi"] - a["estimate"]) * 100 for a in att],
                arrayminus=[(a["estimate"] - a["lo"]) * 100 for a in att],
            ),
            customdata=[[a["lo"] * 100, a["hi"] * 100] for a in att],
            hovertemplate="%{y}<br>attainment %{x:.2f}% [%{customdata[0]:.2f}, %{customdata[1]:.2f}]<extra></extra>",
        ),
        row=1,
        col=1,
    )
    diffs = [
        (label, c, e["vs_control"]["attainment_difference"])
        for label, c, e in zip(labels, colors, rows, strict=True)
        if e["vs_control"]
    ]
    fig.add_trace(
        go.Scatter(
            x=[d["estimate"] * 100 for _, _, d in diffs],
            y=[label for label, _, _ in diffs],
            mode="markers",
            name=f"difference to {control}",
            marker=dict(color=[c for _, c, _ in diffs], size=11),
            error_x=dict(
                type="data",
                symmetric=False,
                thickness=2,
                width=6,
                array=[(d["hi"] - d["estimate"]) * 100 for _, _, d in diffs],
                arrayminus=[(d["estimate"] - d["lo"]) * 100 for _, _, d in diffs],
            ),
            customdata=[[d["lo"] * 100, d["hi"] * 100] for _, _, d in diffs],
            hovertemplate="%{y}<br>%{x:+.2f} pp [%{customdata[0]:+.2f}, %{customdata[1]:+.2f}]<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.add_vline(
        x=target * 100,
        line=dict(color="black", dash="dash"),
        row=1,
        col=1,
        annotation_text=f"target {target:.1%}",
        annotation_position="top",
    )
    fig.add_vline(
        x=0,
        line=dict(color="#555", width=1),
        row=1,
        col=2,
        annotation_text=f"= {control}",
        annotation_position="top",
    )
    lows = [a["lo"] * 100 for a in att] + [target * 100]
    highs = [a["hi"] * 100 for a in att] + [target * 100]
    pad = max(0.5, (max(highs) - min(lows)) * 0.08)
    fig.update_xaxes(
        title="attainment, % (95% CI)",
        range=[min(lows) - pad, min(100.0, max(highs)) + pad],
        ticksuffix="%",
        row=1,
        col=1,
    )
    spread = [d["lo"] * 100 for _, _, d in diffs] + [d["hi"] * 100 for _, _, d in diffs] + [0.0]
    dpad = max(0.5, (max(spread) - min(spread)) * 0.08)
    fig.update_xaxes(
        title=f"difference to {control}, pp (95% CI)",
        range=[min(spread) - dpad, max(spread) + dpad],
        zeroline=False,
        row=1,
        col=2,
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(height=110 + 46 * len(rows), showlegend=False, margin=dict(l=10, r=24, t=28, b=50))
    fig.update_yaxes(automargin=True)
    return finish_figure(fig, None)


# ---- why: one chart per question ----------------------------------------------------------


def attribution(report: Mapping[str, Any], variant: str) -> Drawn:
    """The variant's attainment difference to the control as a waterfall, left to right: each
    factor's contribution (its control and variant level under it), what no single factor
    explains ("other"), then the total the bars add up to."""
    entry = report["attribution"]["attainment"][variant]
    if not entry["contributions"]:
        return entry.get("note") or f"{variant} differs from the control in no factor: nothing to attribute."
    levels = entry.get("levels") or {}
    names, values = [], []
    for factor, value in entry["contributions"].items():
        lv = levels.get(factor) or {}
        names.append(f"{factor}<br>{lv.get('control', '?')} → {lv.get('variant', '?')}" if lv else factor)
        values.append(value)
    if entry["residual"]:
        names.append("other<br>(interaction, rest)")
        values.append(entry["residual"])
    total = entry["total"]
    fig = go.Figure(
        go.Waterfall(
            x=[*names, "total difference"],
            measure=["relative"] * len(values) + ["total"],
            y=[x * 100 for x in values] + [total * 100],
            text=[_pp(x) for x in values] + [_pp(total)],
            textposition="outside",
            cliponaxis=False,
            connector=dict(line=dict(color="#999", dash="dot")),
            increasing=dict(marker=dict(color=GAIN)),
            decreasing=dict(marker=dict(color=LOSS)),
            totals=dict(marker=dict(color=TOTAL)),
            hovertemplate="%{x}: %{text}<extra></extra>",
        )
    )
    running, points = 0.0, [0.0]
    for x in values:
        running += x * 100
        points.append(running)
    points.append(total * 100)
    lo, hi = min(points), max(points)
    pad = max(0.5, (hi - lo) * 0.2)
    # padded below 0 as well: the y axis' "0" on the x axis ran into the first bar's label
    fig.update_yaxes(
        title="attainment Δ, pp", range=[lo - pad, hi + pad], zeroline=True, zerolinecolor="#555"
    )
    fig.update_xaxes(type="category")
    fig.update_layout(showlegend=False, height=320)
    return finish_figure(fig, None)


def phases(report: Mapping[str, Any]) -> Drawn:
    variants = [v for v, p in report["phases"].items() if p.get("phases")]
    if not variants:
        return "No request missed the SLA in this selection: there is no missed TTFT to split into phases."
    fig = go.Figure()
    for i, phase in enumerate(PHASES):
        fig.add_trace(
            go.Bar(
                y=variants,
                x=[report["phases"][v]["phases"][phase]["mean_ms"] or 0 for v in variants],
                name=PHASE_LABELS[phase],
                orientation="h",
                marker_color=PHASE_COLORS[i % len(PHASE_COLORS)],
            )
        )
    fig.update_layout(barmode="stack", height=190 + 40 * len(variants))
    fig.update_xaxes(title="mean ms per missed request")
    fig.update_yaxes(autorange="reversed", automargin=True)
    return finish_figure(fig, None)


SERVER_PHASE_COLORS = {
    "schedule_lag": "#bbbbbb",
    "gateway": "#9467bd",
    "network": "#8c564b",
    "server_queue": "#d62728",
    "server_prefill": "#1f77b4",
    "other": "#17becf",
}


def phases_server(report: Mapping[str, Any]) -> Drawn:
    """The miss phases split by the server's queue and prefill: an interval estimate (report
    phases[v].server_split, basis "interval_aggregates"), not a per-request measurement."""
    splits = {
        v: p["server_split"]
        for v, p in report["phases"].items()
        if (p.get("server_split") or {}).get("available")
    }
    if not splits:
        whys = [(p.get("server_split") or {}).get("why") for p in report["phases"].values()]
        why = next((w for w in whys if w), "no variant has server metrics for its missed requests")
        return f"No split by the servers' own queue and prefill: {why}."
    names = next(list(s["phases"]) for s in splits.values())
    fig = go.Figure()
    for phase in names:
        fig.add_trace(
            go.Bar(
                y=list(splits),
                x=[splits[v]["phases"][phase]["mean_ms"] for v in splits],
                name=next(iter(splits.values()))["phases"][phase]["label"],
                orientation="h",
                marker_color=SERVER_PHASE_COLORS.get(phase, "#555555"),
            )
        )
    fig.update_layout(barmode="relative", height=210 + 40 * len(splits))
    fig.update_xaxes(title="mean ms per missed request (interval estimate)")
    fig.update_yaxes(autorange="reversed", automargin=True)
    return finish_figure(fig, None)


def segment_heatmap(report: Mapping[str, Any], dim: str) -> Drawn:
    """Attainment per segment (rows, in the report's order) and variant (columns): the segment
    labels down the y axis, where they have room at any width."""
    seg = report["segments"][dim]
    variants = list(seg["variants"])
    # segments no variant has a request in are left out: empty rows only push the others apart
    labels = [lab for lab in seg["labels"] if any(seg["variants"][v][lab]["n"] for v in variants)]
    if not labels:
        return "No request in this selection has a segment to show."
    z, text = [], []
    for lab in labels:
        cells = [seg["variants"][v][lab] for v in variants]
        z.append([c["attainment"] for c in cells])
        text.append([f"{c['attainment']:.1%}<br>n={c['n']}" if c["n"] else "" for c in cells])
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=variants,
            y=labels,
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=11),
            colorscale="RdYlGn",
            zmin=max(0.0, report["experiment"]["sla"]["target"] - 0.3),
            zmax=1.0,
            colorbar=dict(tickformat=".0%", thickness=12),
            hoverongaps=False,
        )
    )
    fig.update_xaxes(type="category", side="top")
    fig.update_yaxes(
        type="category",
        autorange="reversed",
        automargin=True,
        title="prompt tokens" if dim == "prompt_tokens" else "requests in flight",
    )
    fig.update_layout(height=110 + 40 * len(labels), margin=dict(t=36, b=16))
    return finish_figure(fig, None)


# ---- how latency and traffic looked ---------------------------------------------------------


def ttft_cdf(report: Mapping[str, Any]) -> Drawn:
    if not any(c["ttft_ms"] for c in report["cdf"].values()):
        return "No successful request with a TTFT in this selection: there is no distribution to draw."
    fig = go.Figure()
    top = 0.0
    for i, (v, cdf) in enumerate(report["cdf"].items()):
        top = max(top, cdf["ttft_ms"][-1] if cdf["ttft_ms"] else 0.0)
        fig.add_trace(
            go.Scatter(
                x=cdf["ttft_ms"], y=cdf["share"], mode="lines", name=v, line=dict(color=series_color(i))
            )
        )
    sla = report["experiment"]["sla"]["ttft_ms"]
    # the label left of the line, inside the plot: at its top right it ran past the figure's edge
    fig.add_vline(
        x=sla,
        line=dict(color="black", dash="dash"),
        annotation_text=f"SLA {sla:g} ms",
        annotation_position="bottom left",
    )
    fig.update_xaxes(title="TTFT (ms)", range=[0, max(top, sla) * 1.05])
    # no tick at 0: its label sat on the x axis' own 0
    fig.update_yaxes(
        title="share of successful requests",
        range=[0, 1.02],
        tickvals=[0.25, 0.5, 0.75, 1.0],
        tickformat=".0%",
    )
    return finish_figure(fig, None)


def p99_over_time(report: Mapping[str, Any]) -> Drawn:
    ts = report["timeseries"]
    if not any(ts["p99_ttft_ms"].values()):
        return "No successful request with a TTFT in this selection: there is no p99 to follow over time."
    fig = go.Figure()
    for i, (v, points) in enumerate(ts["p99_ttft_ms"].items()):
        fig.add_trace(
            go.Scatter(
                x=[p["t"] for p in points],
                y=[p["p99"] for p in points],
                mode="lines+markers",
                name=v,
                line=dict(color=series_color(i)),
                marker=dict(size=4),
            )
        )
    for i, m in enumerate(ts["markers"]):
        # plotly's add_vline cannot annotate date axes reliably: a shape plus an annotation;
        # the labels step down in three rows so that close markers do not write over each other
        fig.add_shape(
            type="line",
            x0=m["at"],
            x1=m["at"],
            y0=0,
            y1=1,
            yref="paper",
            line=dict(color="#555", dash="dot"),
        )
        fig.add_annotation(
            x=m["at"],
            y=1,
            yref="paper",
            text=m["label"],
            showarrow=False,
            yanchor="top",
            xanchor="left",
            yshift=-14 * (i % 3),
            font=dict(size=10),
            bgcolor="rgba(255,255,255,0.8)",
        )
    sla = report["experiment"]["sla"]["ttft_ms"]
    fig.add_hline(y=sla, line=dict(color="black", dash="dash"))
    fig.update_yaxes(title="p99 TTFT (ms)")
    return finish_figure(fig, None)


def server_vs_client(report: Mapping[str, Any]) -> Drawn:
    """Per variant: the client's TTFT (p50, p99: exact, from the samples) beside the server's own
    TTFT, queue and prefill times (means: exact; from the variant's /metrics)."""
    server = report.get("server") or {}
    entries = server.get("variants") or {}
    if not server.get("available") or not entries:
        return "No server metrics were scraped during these runs: only the client's TTFT is known."
    fig = go.Figure()
    keys = list(entries)
    bars = (
        ("client TTFT p50", lambda e: e["client_ttft_ms"].get("p50")),
        ("client TTFT p99", lambda e: e["client_ttft_ms"].get("p99")),
        ("server TTFT mean", lambda e: e["ttft_ms"]["mean_ms"]),
        ("server queue mean", lambda e: e["queue_ms"]["mean_ms"]),
        ("server prefill mean", lambda e: e["prefill_ms"]["mean_ms"]),
    )
    for i, (name, get) in enumerate(bars):
        fig.add_trace(
            go.Bar(x=keys, y=[get(entries[k]) for k in keys], name=name, marker_color=series_color(i))
        )
    fig.update_layout(barmode="group")
    fig.update_yaxes(title="ms")
    return finish_figure(fig, None)


def srm(report: Mapping[str, Any]) -> Drawn:
    s = report["srm"]
    if not s.get("applicable"):
        return f"No traffic split to check: {s.get('note') or 'not applicable to these runs'}."
    comb = s["combined"]
    total = max(comb["total"], 1)
    keys = list(comb["observed"])
    fig = go.Figure()
    fig.add_trace(go.Bar(x=keys, y=[comb["observed"][k] / total for k in keys], name="observed"))
    fig.add_trace(
        go.Bar(x=keys, y=[comb["expected"][k] / total for k in keys], name="expected by the weights")
    )
    fig.update_yaxes(title="share of requests", tickformat=".1%")
    return finish_figure(fig, None)


def divergence(report: Mapping[str, Any]) -> Drawn:
    """Per variant compared with the control in a mirror replay: the share of its compared
    answers that have parted from the control's by each token position (a step curve rising to
    1 - identical share), so where answers part reads off the x axis and how many off the y."""
    rows = [(e["key"], e["fidelity"]) for e in report["variants"] if e.get("fidelity")]
    rows = [(k, f) for k, f in rows if f["compared"]]
    if not rows:
        return (
            "No answers compared with the control's: a mirror replay fingerprints them (docs/report-json.md)."
        )
    fig = go.Figure()
    unit = "token"
    order = [e["key"] for e in report["variants"]]  # each variant's colour, as on the other charts
    for key, fid in rows:
        i = order.index(key)
        pos = fid["first_divergence"]
        unit = pos["unit"] if pos["unit"] != "token" else unit
        x, y, seen = [0], [0.0], 0
        for p, c in zip(pos["positions"], pos["counts"], strict=True):
            seen += c
            x.append(p)
            y.append(seen / fid["compared"])
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                line=dict(shape="hv", color=series_color(i)),
                name=f"{key} ({fid['diverged']:,} of {fid['compared']:,})",
                hovertemplate=f"{key}: %{{y:.2%}} parted by position %{{x}}<extra></extra>",
            )
        )
    fig.update_xaxes(title=f"position of the first differing {unit}", rangemode="tozero")
    fig.update_yaxes(title="share of answers parted", tickformat=".0%", rangemode="tozero")
    return finish_figure(fig, None)


# ---- the page's charts --------------------------------------------------------------------


def _srm_p(report: Mapping[str, Any]) -> str:
    comb = report["srm"].get("combined") if report["srm"].get("applicable") else None
    return f" (SRM p={comb['p_value']:.3g})" if comb else ""


ATTRIBUTION_CAPTION = (
    "Green: raised attainment, red: lowered it; each bar is one factor (control level → "
    "variant level), the grey bar the total difference the bars add up to."
)
SERVER_SPLIT_CAPTION = (
    "An interval estimate: each missed request gets the mean queue and prefill time of the "
    "requests its server finished around it (the server's histograms), not its own."
)
DIVERGENCE_CAPTION = (
    "Greedy answers of the same requests in the mirror replay, compared by fingerprint: each curve "
    "rises at the positions where answers first differ, to the share that differ at all."
)
WIDE = ("p99-time",)  # charts that take the page's width: time runs along x
SECTION_TITLES = {"why": "Why", "latency": "TTFT and traffic"}


def _chart(chart_id: str, section: str, title: str, drawn: Drawn, caption: str = "") -> dict[str, Any]:
    body = {"empty": drawn} if isinstance(drawn, str) else {"figure": drawn, "caption": caption}
    return {
        "id": chart_id,
        "section": section,
        "title": title,
        "script_id": f"figure-{chart_id}",
        "wide": chart_id in WIDE,
        **body,
    }


def page_sections(charts: list[dict[str, Any]]) -> dict[str, Any]:
    """all_figures' charts as the page lays them out: the answer's, then a section per kind."""
    sections = [
        {"id": name, "title": title, "charts": [c for c in charts if c["section"] == name]}
        for name, title in SECTION_TITLES.items()
    ]
    return {"answer": [c for c in charts if c["section"] == "answer"], "sections": sections}


def all_figures(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """[{"id", "section", "title", "figure" | "empty"}] in page order."""
    exp = report["experiment"]
    control, sla = exp["control"], exp["sla"]["ttft_ms"]
    charts = [
        _chart(
            "attainment",
            "answer",
            f"Attainment against the target, and the difference to {control}",
            forest(report),
        )
    ]
    attributed = report["attribution"]["attainment"]
    for v in attributed:
        charts.append(
            _chart(
                f"attribution-{v}",
                "why",
                f"What moved {v}'s attainment against {control}'s?",
                attribution(report, v),
                ATTRIBUTION_CAPTION,
            )
        )
    if not attributed:
        why = report["attribution"].get("note") or "no variant but the control was read: nothing to attribute"
        charts.append(
            _chart(
                "attribution",
                "why",
                "Which factors moved attainment against the control?",
                f"{why[0].upper()}{why[1:]}.",
            )
        )
    if any(e.get("fidelity") for e in report["variants"]):
        charts.append(
            _chart(
                "divergence",
                "why",
                f"Where do the answers part from {control}'s?",
                divergence(report),
                DIVERGENCE_CAPTION,
            )
        )
    charts += [
        _chart("phases", "why", "Where did the TTFT of the missed requests go?", phases(report)),
        _chart(
            "phases-server",
            "why",
            "Missed requests: network, server queue or prefill?",
            phases_server(report),
            SERVER_SPLIT_CAPTION,
        ),
        _chart(
            "seg-prompt",
            "why",
            "Which prompt lengths miss the SLA?",
            segment_heatmap(report, "prompt_tokens"),
        ),
        _chart(
            "seg-inflight",
            "why",
            "Do misses come with load (requests in flight)?",
            segment_heatmap(report, "in_flight"),
        ),
        _chart("cdf", "latency", f"How does TTFT fall against the {sla:g} ms SLA?", ttft_cdf(report)),
        _chart(
            "server", "latency", "Does the server see the TTFT the client sees?", server_vs_client(report)
        ),
        _chart("srm", "latency", f"Did traffic split as the weights say?{_srm_p(report)}", srm(report)),
        _chart(
            "p99-time",
            "latency",
            f"Did p99 TTFT move during the run? (per {report['timeseries']['bucket_s']} s; weight and config changes marked)",
            p99_over_time(report),
        ),
    ]
    return charts
