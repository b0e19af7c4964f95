"""A seeded, skewed user population for traces that carry no user ids. Pure.

Production traffic is skewed: a few heavy users send much of it and a long tail sends a
little. Users are ranked 1..n and drawn with probability proportional to 1/rank**s (Zipf).
A request's user depends only on (seed, seq), so a replay is reproducible and a resumed shard
sees the same users.
"""

from __future__ import annotations

import bisect
import hashlib
import struct


class UserPopulation:
    def __init__(self, size: int = 5000, skew: float = 1.1, seed: int = 0):
        if size < 1:
            raise ValueError(f"population size must be at least 1, got {size}")
        if skew < 0:
            raise ValueError(f"skew must be >= 0, got {skew}")
        self.size, self.skew, self.seed = size, skew, seed
        weights = [1.0 / (rank**skew) for rank in range(1, size + 1)]
        total = sum(weights)
        self._cdf, acc = [], 0.0
        for w in weights:
            acc += w / total
            self._cdf.append(acc)
        self._cdf[-1] = 1.0

    def _uniform(self, seq: int) -> float:
        digest = hashlib.blake2b(f"{self.seed}:{seq}".encode(), digest_size=8).digest()
        return (struct.unpack(">Q", digest)[0] >> 11) / float(1 << 53)

    def user_for(self, seq: int) -> str:
        rank = bisect.bisect_right(self._cdf, self._uniform(seq))
        return f"user-{min(rank, self.size - 1) + 1:06d}"
