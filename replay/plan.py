"""Cutting a run into shards on one absolute schedule. Pure.

Every request has a send offset from the run's start. Slots interleave requests (request i
goes to slot i mod S) so that all slots are busy at once and S workers together reproduce the
arrival process at S times the capacity of one; a shard knows the run's start time, so a late
start shows up as schedule lag rather than a shifted schedule.

Windows bound the work of one task: an open-loop schedule is cut into windows of ``window_s``
seconds (request i belongs to window floor(offset_i / window_s)), and a shard is one (window,
slot). A shard sends its requests at their absolute offsets on the run's one clock, so windows
join without a gap or a burst at their seams; each window's tasks are queued shortly before it
opens (workers/tasks.py). Windows with no requests have no shards.

Request ids are deterministic: one per (run, request) in split mode, one per (run, request,
variant) in mirror mode. They key the exactly-once guarantee: a shard that is redelivered
asks the sample store which ids it already has and sends only the rest.
"""

from __future__ import annotations

import dataclasses

# The one definition of a request's id is the samples row's (samples.rows.row_from derives the
# same when a writer gives none): the replay sends these.
from samples.rows import request_id as request_id

SPLIT, MIRROR = "split", "mirror"


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def owns(self, seq: int) -> bool:
        return seq % self.count == self.index

    def seqs(self, total: int) -> range:
        return range(self.index, total, self.count)


@dataclasses.dataclass(frozen=True)
class WindowShard:
    """One task's share of a run: the requests of one time window in one slot."""

    window: int  # the window's index: it covers [window * window_s, (window + 1) * window_s)
    slot: int
    positions: tuple[int, ...]  # indexes into the run's (thinned) request list, in send order
    start_s: float  # the window's bounds, seconds after the run's start (0, inf: one window)
    end_s: float


def window_of(offset_s: float, window_s: float | None) -> int:
    """The window a send offset falls in (0 for everything when there are no windows)."""
    if window_s is None:
        return 0
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return int(max(0.0, offset_s) // window_s)


def window_shards(
    offsets: list[float] | None, total: int, slots: int, window_s: float | None
) -> list[WindowShard]:
    """Cut a run of ``total`` requests sent at ``offsets`` (None: closed loop, one window) into
    (window, slot) shards, in window then slot order. Every position is in exactly one shard;
    slot = position mod ``slots``, as before windows, so each slot carries an even share."""
    if slots < 1:
        raise ValueError(f"slot count must be at least 1, got {slots}")
    if offsets is not None and len(offsets) != total:
        raise ValueError(f"{len(offsets)} offsets for {total} requests")
    if offsets is None or window_s is None:
        return [
            WindowShard(0, s, tuple(range(s, total, slots)), 0.0, float("inf"))
            for s in range(min(slots, max(total, 1)))
        ]
    cells: dict[tuple[int, int], list[int]] = {}
    for i, off in enumerate(offsets):
        cells.setdefault((window_of(off, window_s), i % slots), []).append(i)
    return [
        WindowShard(w, s, tuple(pos), w * window_s, (w + 1) * window_s)
        for (w, s), pos in sorted(cells.items())
    ]


def shards(total_requests: int, shard_count: int) -> list[Shard]:
    if shard_count < 1:
        raise ValueError(f"shard count must be at least 1, got {shard_count}")
    return [Shard(i, shard_count) for i in range(min(shard_count, max(total_requests, 1)))]


def expected_samples(total_requests: int, mode: str, n_variants: int) -> int:
    return total_requests * (n_variants if mode == MIRROR else 1)
