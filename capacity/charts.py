"""Plotly figures of a capacity search (models.CapacitySearch.result): attainment against rate
with each step's confidence band and the target line, and TTFT p50/p99 against rate; one curve
per variant. Built from the stored result only (no queries)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from dashboards.charts import finish_figure, series_color

# Room for the rotated y-axis title beside the tick labels, the x-axis title under its ticks and
# the legend under both (the dashboard's layout puts its legend where this x title is).
HEIGHT = 380
MARGIN = dict(l=72, r=24, t=48, b=96)
LEGEND = dict(orientation="h", x=0, y=-0.27, yanchor="top")


def _finish(fig: go.Figure, title: str) -> dict[str, Any]:
    fig.update_layout(height=HEIGHT)
    out = finish_figure(fig, title)
    out["layout"].update(margin=MARGIN, legend=LEGEND)
    return out


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2 and 5 times the powers of ten from just below ``lo`` to just above ``hi``."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    every = [m * 10.0**k for k in range(first, last + 1) for m in (1, 2, 5)]
    return [t for t in every if lo / 2.5 <= t <= hi * 2.5]


def why_empty(figure: Mapping[str, Any], status: str) -> str:
    """The sentence an empty chart shows instead of axes with nothing on them ("" when the
    figure has points)."""
    if any(t.get("x") for t in figure.get("data", [])):
        return ""
    if status == "running":
        return (
            "No step has judged a request yet: the search is running, and each step shows here once it ends."
        )
    if status == "failed":
        return "The search failed before any step judged a request: its error is above."
    return "No step of this search judged a request, so there is no attainment or TTFT to draw."


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
        fig.add_trace(
            go.Scatter(
                x=x + x[::-1],
                y=hi + lo[::-1],
                fill="toself",
                line=dict(width=0),
                fillcolor=series_color(i),
                opacity=0.18,
                hoverinfo="skip",
                showlegend=False,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers",
                name=v,
                line=dict(color=series_color(i)),
                text=[
                    f"{s['verdict']} (capacity step run {s['run_id']}, {s['n']} requests judged)"
                    for s in steps
                ],
                hovertemplate="%{x:g} req/s: %{y:.2%} %{text}<extra>" + v + "</extra>",
            )
        )
        if r.get("capacity_rps"):
            fig.add_vline(x=r["capacity_rps"], line=dict(color=series_color(i), dash="dot", width=1))
    fig.add_hline(y=target, line=dict(color="#000", dash="dash"), annotation_text=f"target {target:.2%}")
    fig.update_xaxes(title="request rate (req/s)", type="log")
    fig.update_yaxes(title="SLA attainment", tickformat=".1%")
    return _finish(fig, "Attainment against load (dotted: SLA capacity)")


def ttft_vs_rate(result: Mapping[str, Any]) -> dict[str, Any]:
    fig = go.Figure()
    for i, (v, r) in enumerate(result.items()):
        steps = [s for s in _steps(r) if s.get("ttft_p50_ms") is not None]
        x = [s["rate_rps"] for s in steps]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[s["ttft_p50_ms"] for s in steps],
                mode="lines+markers",
                name=f"{v} p50",
                line=dict(color=series_color(i), dash="dot"),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[s["ttft_p99_ms"] for s in steps],
                mode="lines+markers",
                name=f"{v} p99",
                line=dict(color=series_color(i)),
            )
        )
    fig.update_xaxes(title="request rate (req/s)", type="log")
    ms = [y for t in fig.data for y in (t.y or ()) if y]
    ticks = _log_ticks(min(ms), max(ms)) if ms else None
    # whole numbers at 1, 2 and 5 per decade: plotly's own log ticks label 20 and 50 as "2", "5"
    fig.update_yaxes(title="TTFT (ms)", type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks or ()])
    return _finish(fig, "TTFT p50 and p99 against load")


def capacity_vs_fidelity(
    result: Mapping[str, Any], fidelity: Mapping[str, Mapping[str, Any] | None], control: str
) -> dict[str, Any]:
    """What a variant carries against what it answers: SLA capacity (req/s) on the y axis, the
    share of its answers identical to the control's in the mirror replay on the x axis (with
    its interval as error bars; the control is the reference, 100%). Buttons switch the y axis
    to the cost per million requests. A variant without a capacity or without compared answers
    is left out (the table says why)."""
    fig = go.Figure()
    ys: dict[str, list[float | None]] = {"capacity": [], "cost": []}
    currencies = {(r.get("cost") or {}).get("currency") for r in result.values()} - {None, ""}
    cost_title = "cost per 1M requests" + (f" ({next(iter(currencies))})" if len(currencies) == 1 else "")
    for i, (v, r) in enumerate(result.items()):
        ident = ((fidelity.get(v) or {}).get("identical")) if v != control else None
        if v == control:
            x, lo, hi = 1.0, 1.0, 1.0
        elif ident:
            x = ident["estimate"]
            lo = ident["lo"] if ident["lo"] is not None else x
            hi = ident["hi"] if ident["hi"] is not None else x
        else:
            continue
        capacity = r.get("capacity_rps")
        cost = (r.get("cost") or {}).get("per_million_requests")
        if capacity is None and cost is None:
            continue
        currency = (r.get("cost") or {}).get("currency", "")
        ys["capacity"].append(capacity)
        ys["cost"].append(cost)
        label = "reference" if v == control else f"{x:.1%} identical"
        fig.add_trace(
            go.Scatter(
                x=[x],
                y=[capacity],
                error_x=dict(type="data", symmetric=False, array=[hi - x], arrayminus=[x - lo], width=4),
                mode="markers+text",
                marker=dict(size=12, color=series_color(i)),
                text=[v],
                textposition="top center",
                name=v,
                hovertemplate=(
                    f"{v}: {label}; capacity {'-' if capacity is None else f'{capacity:g} req/s'}; "
                    f"{'-' if cost is None else f'{cost:,.2f} {currency}'.strip()} per 1M requests<extra></extra>"
                ),
            )
        )

    def room(values: list[float | None]) -> list[float]:
        # from 0 to a quarter above the highest point: the variant's name above it stays inside
        top = max((v for v in values if v is not None), default=1.0)
        return [0.0, 1.25 * top]

    fig.update_xaxes(title=f"answers identical to {control}'s", tickformat=".0%")
    fig.update_yaxes(title="SLA capacity (req/s)", range=room(ys["capacity"]))
    if fig.data:
        fig.update_layout(
            updatemenus=[
                dict(
                    type="buttons",
                    direction="right",
                    x=1.0,
                    xanchor="right",
                    y=1.12,
                    yanchor="bottom",
                    showactive=True,
                    buttons=[
                        dict(
                            label="capacity",
                            method="update",
                            args=[
                                {"y": [[y] for y in ys["capacity"]]},
                                {
                                    "yaxis.title.text": "SLA capacity (req/s)",
                                    "yaxis.range": room(ys["capacity"]),
                                },
                            ],
                        ),
                        dict(
                            label="cost",
                            method="update",
                            args=[
                                {"y": [[y] for y in ys["cost"]]},
                                {"yaxis.title.text": cost_title, "yaxis.range": room(ys["cost"])},
                            ],
                        ),
                    ],
                )
            ]
        )
    return _finish(fig, "Capacity against answers identical to the control")
