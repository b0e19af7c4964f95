"""Plotly figures of a capacity search (models.CapacitySearch.result): attainment against rate
with each step's confidence band and the target line, and TTFT p50/p99 against rate; one curve
per variant. Built from the stored result only (no queries)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from dashboards.charts import finish_figure, series_color


def _steps(r: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The steps that count, by rate (not a void step its retry at the same rate superseded)."""
    steps = (s for s in r.get("steps", []) if s.get("n") and s.get("counted", True))
    return sorted(steps, key=lambda s: s["rate_rps"])


def attainment_vs_rate(result: Mapping[str, Any], target: float) -> dict[str, Any]:
    fig = go.Figure()
    for i, (v, r) in enumerate(result.items()):
        steps = _steps(r)
        x = [s["rate_rps"] for s in steps]
        y = [s["hits"] / s["n"] for s in steps]
        lo = [
            s["attainment_lo"] if s["attainment_lo"] is not None else yy
            for s, yy in zip(steps, y, strict=True)
        ]
        hi = [
            s["attainment_hi"] if s["attainment_hi"] is not None else yy
            for s, yy in zip(steps, y, strict=True)
        ]
        fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself", line=dict(width=0),
                                 fillcolor=series_color(i), opacity=0.18, hoverinfo="skip", showlegend=False))  # fmt: skip
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers", name=v, line=dict(color=series_color(i)),
            text=[f"{s['verdict']} (run {s['run_id']}, n={s['n']})" for s in steps],
            hovertemplate="%{x:.3g} req/s: %{y:.2%} %{text}<extra>" + v + "</extra>",
        ))  # fmt: skip
        if r.get("capacity_rps"):
            fig.add_vline(x=r["capacity_rps"], line=dict(color=series_color(i), dash="dot", width=1))
    fig.add_hline(y=target, line=dict(color="#000", dash="dash"), annotation_text=f"target {target:.2%}")
    fig.update_xaxes(title="request rate (req/s)", type="log")
    fig.update_yaxes(title="SLA attainment (band: anytime-valid, per step)", tickformat=".0%")
    return finish_figure(fig, "Attainment against load; dotted: SLA capacity")


def ttft_vs_rate(result: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    for i, (v, r) in enumerate(result.items()):
        steps = [s for s in _steps(r) if s.get("ttft_p50_ms") is not None]
        x = [s["rate_rps"] for s in steps]
        fig.add_trace(go.Scatter(x=x, y=[s["ttft_p50_ms"] for s in steps], mode="lines+markers",
                                 name=f"{v} p50", line=dict(color=series_color(i), dash="dot")))  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[s["ttft_p99_ms"] for s in steps], mode="lines+markers",
                                 name=f"{v} p99", line=dict(color=series_color(i))))  # fmt: skip
    fig.update_xaxes(title="request rate (req/s)", type="log")
    fig.update_yaxes(title="TTFT (ms)", type="log")
    return finish_figure(fig, "TTFT percentiles against load (after each step's warm-up)")
