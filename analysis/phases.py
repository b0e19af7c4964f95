"""How the TTFT of missed requests splits into phases: schedule lag (a replay's) or the gateway's
time (a live request's), connect, headers, headers -> first event, first event -> first content
(analysis.definitions.PHASES). Pure numpy."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis.definitions import PHASE_COLUMNS, PHASE_LABELS, PHASES


def phases_from_sums(t: Mapping[str, float]) -> dict[str, float]:
    """Phase totals from the sums of the timestamps (definitions.PHASE_COLUMNS keys)."""
    if sorted(t) != sorted(PHASE_COLUMNS):
        raise ValueError(f"phases_from_sums: need sums of {sorted(PHASE_COLUMNS)}, got {sorted(t)}")
    return {
        "schedule_lag": t["schedule_lag"],
        "gateway": t["gateway"],
        "connect": t["connect"],
        "headers": t["ttfb"] - t["connect"],
        "headers_to_first_event": t["ttft_event"] - t["ttfb"],
        "first_event_to_first_content": t["ttft"] - t["ttft_event"],
    }


def phase_arrays(
    schedule_lag_ms: np.ndarray | Sequence[float] | None,
    connect_ms: np.ndarray | Sequence[float | None],
    ttfb_ms: np.ndarray | Sequence[float | None],
    ttft_event_ms: np.ndarray | Sequence[float | None],
    ttft_ms: np.ndarray | Sequence[float | None],
    gateway_ms: np.ndarray | Sequence[float] | None = None,
) -> dict[str, np.ndarray]:
    """Per-request phases (ms) from the samples' columns; they sum to lag + gateway + ttft_ms.

    The StreamResult clock starts when the request is written, so what came before it is added
    on top: schedule lag (how late a replay sent it) or the gateway's time (a live request's,
    from the client's request received); each is 0 in the other's samples, and a missing one is
    0. connect_ms is None on a reused connection (0 ms of connect). Other missing values stay
    NaN and phase_breakdown drops those requests.
    """

    def arr(x: Any) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in x], dtype=float)

    ttft = arr(ttft_ms)
    n = ttft.size
    lag = np.zeros(n) if schedule_lag_ms is None else np.nan_to_num(arr(schedule_lag_ms))
    gateway = np.zeros(n) if gateway_ms is None else np.nan_to_num(arr(gateway_ms))
    connect = np.nan_to_num(arr(connect_ms))
    ttfb, event = arr(ttfb_ms), arr(ttft_event_ms)
    for label, a in (
        ("schedule_lag_ms", lag),
        ("gateway_ms", gateway),
        ("connect_ms", connect),
        ("ttfb_ms", ttfb),
    ):
        if a.shape != (n,):
            raise ValueError(f"phase_arrays: {label} has shape {a.shape}, ttft_ms has ({n},)")
    if event.shape != (n,):
        raise ValueError(f"phase_arrays: ttft_event_ms has shape {event.shape}, ttft_ms ({n},)")
    return {
        "schedule_lag": lag,
        "gateway": gateway,
        "connect": connect,
        "headers": ttfb - connect,
        "headers_to_first_event": event - ttfb,
        "first_event_to_first_content": ttft - event,
    }


def _check_phase_keys(keys: Sequence[str], where: str) -> None:
    unknown = sorted(set(keys) - set(PHASES))
    missing = sorted(set(PHASES) - set(keys))
    if unknown or missing:
        raise ValueError(f"{where}: phases must be exactly {PHASES}; unknown {unknown}, missing {missing}")


def phase_breakdown(
    phases: Mapping[str, np.ndarray | Sequence[float]],
) -> dict[str, Any]:
    """Share of TTFT per phase over missed requests, from per-request arrays.

    Per phase: mean_ms, median_ms, mean_share (mean over requests of phase / total; these sum
    to 1), median_share (do not sum to 1), share_of_total (sum of phase / sum of totals).
    Requests with a missing phase or a non-positive total are dropped and counted.
    """
    _check_phase_keys(list(phases), "phase_breakdown")
    mat = np.vstack([np.asarray(phases[p], dtype=float) for p in PHASES])
    if mat.ndim != 2:
        raise ValueError("phase_breakdown: every phase must be a 1-d array")
    total = mat.sum(axis=0)
    keep = np.isfinite(mat).all(axis=0) & (total > 0)
    if (mat[:, keep] < 0).any():
        bad = [p for p, row in zip(PHASES, mat[:, keep]) if (row < 0).any()]
        raise ValueError(
            f"phase_breakdown: negative durations in {bad}; timestamps out of order "
            "(headers before connect, first content before first event?)"
        )
    mat, total = mat[:, keep], total[keep]
    out: dict[str, Any] = {
        "n": int(keep.sum()),
        "dropped": int((~keep).sum()),
        "phases": {},
    }
    share = mat / total if total.size else mat
    for i, p in enumerate(PHASES):
        has = total.size > 0
        out["phases"][p] = {
            "label": PHASE_LABELS[p],
            "mean_ms": float(mat[i].mean()) if has else None,
            "median_ms": float(np.median(mat[i])) if has else None,
            "mean_share": float(share[i].mean()) if has else None,
            "median_share": float(np.median(share[i])) if has else None,
            "share_of_total": float(mat[i].sum() / total.sum()) if has else None,
        }
    return out


def phase_breakdown_from_sums(sums: Mapping[str, float], count: int) -> dict[str, Any]:
    """The same split from ClickHouse sums over missed requests (sumIf per phase, countIf)."""
    _check_phase_keys(list(sums), "phase_breakdown_from_sums")
    if count < 0:
        raise ValueError(f"phase_breakdown_from_sums: count must be >= 0, got {count}")
    total = float(sum(sums[p] for p in PHASES))
    bad = [p for p in PHASES if not math.isfinite(sums[p]) or sums[p] < 0]
    if bad:
        raise ValueError(f"phase_breakdown_from_sums: phases {bad} have a negative or NaN sum")
    out: dict[str, Any] = {"n": int(count), "dropped": 0, "phases": {}}
    for p in PHASES:
        out["phases"][p] = {
            "label": PHASE_LABELS[p],
            "mean_ms": sums[p] / count if count else None,
            "share_of_total": sums[p] / total if total > 0 else None,
        }
    return out
