"""Cutting a run into shards on one absolute schedule. Pure.

Every request has a send offset from the run's start. Shards interleave requests
(request i goes to shard i mod S) so that all shards are busy at once and S workers together
reproduce the arrival process at S times the capacity of one; a shard knows the run's start
time, so a late start shows up as schedule lag rather than a shifted schedule.

Request ids are deterministic: one per (run, request) in split mode, one per (run, request,
variant) in mirror mode. They key the exactly-once guarantee: a shard that is redelivered
asks the sample store which ids it already has and sends only the rest.
"""

from __future__ import annotations

import dataclasses

SPLIT, MIRROR = "split", "mirror"


def request_id(run_id: int, seq: int, variant: str | None = None) -> str:
    """The one definition of a request's id: deterministic, the same on every retry and
    redelivery. One per (run, request) in split mode (the router picks the variant), one per
    (run, request, variant) in mirror mode (every variant gets the request). The runner sends
    these, and replay.rows.row_from derives the same when a writer gives none."""
    if variant is not None and not variant:
        raise ValueError("request_id: variant must be a non-empty string or None")
    base = f"r{int(run_id)}-{int(seq)}"
    return f"{base}-{variant}" if variant is not None else base


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def owns(self, seq: int) -> bool:
        return seq % self.count == self.index

    def seqs(self, total: int) -> range:
        return range(self.index, total, self.count)


def shards(total_requests: int, shard_count: int) -> list[Shard]:
    if shard_count < 1:
        raise ValueError(f"shard count must be at least 1, got {shard_count}")
    return [Shard(i, shard_count) for i in range(min(shard_count, max(total_requests, 1)))]


def expected_samples(total_requests: int, mode: str, n_variants: int) -> int:
    return total_requests * (n_variants if mode == MIRROR else 1)
