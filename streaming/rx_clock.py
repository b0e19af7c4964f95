"""Kernel receive stamps on the replay's clock: the kernel stamps a packet on CLOCK_REALTIME,
the measurements run on the perf_counter clock (CLOCK_MONOTONIC); the offset between the two
is sampled here and applied to each stamp (streaming/h1.py, point 4)."""

from __future__ import annotations

import time

_perf = time.perf_counter_ns
_OFFSET_MAX_AGE_NS = 1_000_000_000


def sample_realtime_offset(tries: int = 5) -> tuple[int, int]:
    """(CLOCK_REALTIME - perf_counter clock, error bound), in ns. Each try reads perf, realtime,
    perf back to back; the realtime read lies between the two perf reads, so taking their
    midpoint is off by at most half the gap. The try with the smallest gap wins."""
    best_gap = best_offset = -1
    for _ in range(tries):
        a = _perf()
        real = time.time_ns()
        b = _perf()
        if best_gap < 0 or b - a < best_gap:
            best_gap, best_offset = b - a, real - (a + b) // 2
    return best_offset, (best_gap + 1) // 2


_offset_ns, _, _offset_at = *sample_realtime_offset(), _perf()


def realtime_offset() -> int:
    """The cached offset, re-sampled when older than a second: both clocks are slewed alike by
    NTP, but a step of the realtime clock moves the offset, and this bounds how long a stale one
    is used."""
    global _offset_ns, _offset_at
    now = _perf()
    if now - _offset_at > _OFFSET_MAX_AGE_NS:
        _offset_ns = sample_realtime_offset()[0]
        _offset_at = _perf()
    return _offset_ns


def rx_stamp_ns(rx_realtime_ns: int, offset_ns: int, now_ns: int, floor_ns: int) -> int:
    """A kernel receive stamp on the perf_counter clock. No stamp (0) gives ``now_ns``, the
    clock read; the result never lies after ``now_ns`` (bytes cannot arrive after they were
    read: a later stamp is offset error or a clock step) nor before ``floor_ns`` (the request
    was written, or an earlier read on the connection was stamped, then)."""
    if not rx_realtime_ns:
        return now_ns
    t = rx_realtime_ns - offset_ns
    if t > now_ns:
        return now_ns
    if t < floor_ns:
        return floor_ns
    return t
