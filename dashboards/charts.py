"""Plotly figures for the dashboard, built from the report dict only (no queries here).

Each figure is returned as plain JSON (data + layout) for Plotly.newPlot in the page; the
"none" template keeps each figure a few kB instead of carrying plotly's 10 kB default theme.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from analysis.definitions import METRIC_LABELS, PHASE_LABELS, PHASES

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
PHASE_COLORS = ("#bbbbbb", "#9467bd", "#8c564b", "#ff7f0e", "#1f77b4", "#17becf")  # in PHASES order
_LAYOUT = dict(
    template="none",
    margin=dict(l=60, r=20, t=40, b=50),
    height=340,
    font=dict(family="system-ui, sans-serif", size=12),
    legend=dict(orientation="h", y=-0.2),
)


def series_color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def finish_figure(fig: go.Figure, title: str) -> dict[str, Any]:
    layout = {k: v for k, v in _LAYOUT.items() if k != "height" or fig.layout.height is None}
    fig.update_layout(title=dict(text=title, x=0, font=dict(size=14)), **layout)
    return json.loads(fig.to_json())


def ttft_cdf(report: Mapping[str, Any]) -> dict[str, Any]:
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
    fig.add_vline(x=sla, line=dict(color="black", dash="dash"), annotation_text=f"SLA {sla:g} ms")
    fig.update_xaxes(title="TTFT (ms)", range=[0, max(top, sla) * 1.05])
    fig.update_yaxes(title="share of successful requests", range=[0, 1])
    return finish_figure(fig, "TTFT CDF per variant")


def attainment(report: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    rows = [e for e in report["variants"] if e["attainment"]]
    fig.add_trace(
        go.Bar(
            x=[e["key"] for e in rows],
            y=[e["attainment"]["estimate"] for e in rows],
            marker_color=[series_color(i) for i in range(len(rows))],
            error_y=dict(
                type="data",
                symmetric=False,
                array=[e["attainment"]["hi"] - e["attainment"]["estimate"] for e in rows],
                arrayminus=[e["attainment"]["estimate"] - e["attainment"]["lo"] for e in rows],
            ),
            text=[f"{e['attainment']['estimate']:.2%}<br>{e['verdict']['verdict']}" for e in rows],
            textposition="inside",
            name="attainment (95% Wilson CI)",
        )
    )
    target = report["experiment"]["sla"]["target"]
    fig.add_hline(y=target, line=dict(color="black", dash="dash"), annotation_text=f"target {target:.1%}")
    lows = [e["attainment"]["lo"] for e in rows] + [target]
    fig.update_yaxes(title="SLA attainment", tickformat=".0%", range=[max(0, min(lows) - 0.05), 1])
    return finish_figure(fig, "SLA attainment with 95% CI vs target")


def percentile_table(report: Mapping[str, Any]) -> dict[str, Any]:
    header = ["variant", "metric"]
    cols: list[list[str]] = [[], []]
    labels: list[str] = []
    for e in report["variants"]:
        for metric, ests in e["percentiles"].items():
            cols[0].append(e["key"])
            cols[1].append(METRIC_LABELS.get(metric, metric))
            for j, est in enumerate(ests):
                if len(labels) <= j:
                    labels.append(est["label"])
                    cols.append([])
                cols[2 + j].append(_fmt_est(est))
    fig = go.Figure(
        go.Table(
            header=dict(values=header + [f"{lab} [95% CI] ms" for lab in labels], align="left"),
            cells=dict(values=cols, align="left", height=22),
        )
    )
    fig.update_layout(height=110 + 24 * len(cols[0]))
    return finish_figure(fig, "Latency percentiles (exact, distribution-free 95% CI)")


def _fmt_est(est: Mapping[str, Any]) -> str:
    if est["value"] is None:
        return "-"
    if est["lo"] is None:
        return f"{est['value']:.1f} [n too small]"
    return f"{est['value']:.1f} [{est['lo']:.1f}, {est['hi']:.1f}]"


def p99_over_time(report: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    ts = report["timeseries"]
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
    for m in ts["markers"]:
        # plotly's add_vline cannot annotate date axes reliably: a shape plus an annotation
        fig.add_shape(
            type="line", x0=m["at"], x1=m["at"], y0=0, y1=1, yref="paper",
            line=dict(color="#555", dash="dot"),
        )  # fmt: skip
        fig.add_annotation(
            x=m["at"], y=1, yref="paper", text=m["label"], showarrow=False, yanchor="bottom",
            font=dict(size=10),
        )  # fmt: skip
    sla = report["experiment"]["sla"]["ttft_ms"]
    fig.add_hline(y=sla, line=dict(color="black", dash="dash"))
    fig.update_yaxes(title="p99 TTFT (ms)")
    return finish_figure(fig, f"p99 TTFT per {ts['bucket_s']} s, weight / config changes marked")


def attribution_waterfall(report: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    att = report["attribution"]["attainment"]
    for v, entry in att.items():
        names = list(entry["contributions"]) + (["other"] if entry["residual"] else [])
        values = list(entry["contributions"].values()) + ([entry["residual"]] if entry["residual"] else [])
        fig.add_trace(
            go.Waterfall(
                name=v,
                x=[[v] * (len(names) + 1), [*names, "total"]],
                measure=["relative"] * len(names) + ["total"],
                y=[x * 100 for x in values] + [entry["total"] * 100],
                text=[f"{x * 100:+.2f} pp" for x in values] + [f"{entry['total'] * 100:+.2f} pp"],
                textposition="outside",
                increasing=dict(marker=dict(color="#2ca02c")),
                decreasing=dict(marker=dict(color="#d62728")),
                totals=dict(marker=dict(color="#555555")),
            )
        )
    fig.update_yaxes(title="attainment vs control (pp)")
    fig.update_layout(showlegend=False)
    return finish_figure(fig, "Attribution of the attainment difference by factor")


def phases(report: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    variants = [v for v, p in report["phases"].items() if p.get("phases")]
    for i, phase in enumerate(PHASES):
        fig.add_trace(
            go.Bar(
                x=variants,
                y=[report["phases"][v]["phases"][phase]["mean_ms"] or 0 for v in variants],
                name=PHASE_LABELS[phase],
                marker_color=PHASE_COLORS[i % len(PHASE_COLORS)],
            )
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="mean ms per missed request")
    return finish_figure(fig, "Where TTFT went for requests that missed the SLA")


SERVER_PHASE_COLORS = {"schedule_lag": "#bbbbbb", "gateway": "#9467bd", "network": "#8c564b",
                       "server_queue": "#d62728", "server_prefill": "#1f77b4", "other": "#17becf"}  # fmt: skip


def server_vs_client(report: Mapping[str, Any]) -> dict[str, Any]:
    """Per variant: the client's TTFT (p50, p99: exact, from the samples) beside the server's own
    TTFT, queue and prefill times (means: exact; from the variant's /metrics)."""
    fig = go.Figure()
    entries = report.get("server", {}).get("variants", {})
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
    return finish_figure(fig, "Client TTFT vs the server's own TTFT, queue and prefill (vllm:* metrics)")


def phases_server(report: Mapping[str, Any]) -> dict[str, Any]:
    """The miss phases split by the server's queue and prefill: an interval estimate (report
    phases[v].server_split, basis "interval_aggregates"), not a per-request measurement."""
    fig = go.Figure()
    splits = {
        v: p["server_split"]
        for v, p in report["phases"].items()
        if (p.get("server_split") or {}).get("available")
    }
    names = next((list(s["phases"]) for s in splits.values()), [])
    for phase in names:
        fig.add_trace(
            go.Bar(
                x=list(splits),
                y=[splits[v]["phases"][phase]["mean_ms"] for v in splits],
                name=next(iter(splits.values()))["phases"][phase]["label"],
                marker_color=SERVER_PHASE_COLORS.get(phase, "#555555"),
            )
        )
    fig.update_layout(barmode="relative")
    fig.update_yaxes(title="mean ms per missed request")
    return finish_figure(
        fig, "Missed requests: network, server queue and prefill (interval estimate from server metrics)"
    )


def segment_heatmap(report: Mapping[str, Any], dim: str, title: str) -> dict[str, Any]:
    seg = report["segments"][dim]
    variants = list(seg["variants"])
    z, text = [], []
    for v in variants:
        cells = seg["variants"][v]
        z.append([cells[lab]["attainment"] for lab in seg["labels"]])
        text.append(
            [
                f"{cells[lab]['attainment']:.1%}<br>n={cells[lab]['n']}" if cells[lab]["n"] else ""
                for lab in seg["labels"]
            ]
        )
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=seg["labels"],
            y=variants,
            text=text,
            texttemplate="%{text}",
            colorscale="RdYlGn",
            zmin=max(0.0, report["experiment"]["sla"]["target"] - 0.3),
            zmax=1.0,
            colorbar=dict(tickformat=".0%"),
            hoverongaps=False,
        )  # fmt: skip
    )
    fig.update_xaxes(type="category")
    return finish_figure(fig, title)


def srm(report: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    s = report["srm"]
    if s.get("applicable"):
        comb = s["combined"]
        total = max(comb["total"], 1)
        keys = list(comb["observed"])
        fig.add_trace(go.Bar(x=keys, y=[comb["observed"][k] / total for k in keys], name="observed"))
        fig.add_trace(go.Bar(x=keys, y=[comb["expected"][k] / total for k in keys], name="expected"))
        fig.update_yaxes(tickformat=".1%")
        title = f"Traffic split: observed vs weights (SRM p={comb['p_value']:.3g})"
    else:
        fig.add_trace(go.Bar(x=["n/a"], y=[0], name=s.get("note", "not applicable")))
        title = f"Traffic split: SRM not applicable ({s.get('note', '')})"
    return finish_figure(fig, title)


def all_figures(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """[{"id", "figure"}] in page order."""
    figs = [
        ("attainment", attainment(report)),
        ("cdf", ttft_cdf(report)),
        ("percentiles", percentile_table(report)),
        ("p99-time", p99_over_time(report)),
        ("attribution", attribution_waterfall(report)),
        ("phases", phases(report)),
        ("phases-server", phases_server(report)),
        ("server", server_vs_client(report)),
        ("seg-prompt", segment_heatmap(report, "prompt_tokens", "Attainment by prompt length")),
        ("seg-inflight", segment_heatmap(report, "in_flight", "Attainment by in-flight load")),
        ("srm", srm(report)),
    ]
    return [{"id": k, "figure": f} for k, f in figs]
