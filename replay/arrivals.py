"""Arrival processes: when each request of a replay is sent. Pure.

- recorded: the trace's own timestamps divided by a speed factor (20 = twenty times faster);
- poisson: exponential gaps at a given rate;
- gamma: gamma gaps at a given rate with a coefficient of variation (cv > 1 is burstier than
  Poisson, cv = 1 is Poisson);
- closed: no schedule; a fixed number of requests in flight, the next sent when one ends.
Open-loop offsets are seconds after the run's start.
"""

from __future__ import annotations

import dataclasses
import random

MODES = ("recorded", "poisson", "gamma", "closed")
MIN_RATE, MAX_RATE = 1e-6, 1e6  # requests/s (and the smallest speed factor)
MIN_CV, MAX_CV = 1e-3, 1e3


@dataclasses.dataclass(frozen=True)
class Arrival:
    mode: str = "recorded"
    speed: float = 1.0  # recorded
    rate: float = 0.0  # poisson / gamma: requests per second
    cv: float = 1.0  # gamma: coefficient of variation of the gaps
    concurrency: int = 0  # closed: requests in flight
    seed: int = 0

    def __post_init__(self):
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        # Bounded so the schedule's arithmetic stays finite (a gap is about 1/rate or 1/speed,
        # the gamma shape 1/cv**2): a rate of 1e-300 or a cv of 1e300 would make it inf or NaN.
        if self.mode == "recorded" and not self.speed >= MIN_RATE:
            problems.append(f"speed must be at least {MIN_RATE:g}, got {self.speed}")
        if self.mode in ("poisson", "gamma") and not MIN_RATE <= self.rate <= MAX_RATE:
            problems.append(
                f"rate must be {MIN_RATE:g} to {MAX_RATE:g} requests/s for {self.mode} arrivals, got {self.rate}"
            )
        if self.mode == "gamma" and not MIN_CV <= self.cv <= MAX_CV:
            problems.append(f"cv must be {MIN_CV:g} to {MAX_CV:g}, got {self.cv}")
        if self.mode == "closed" and self.concurrency < 1:
            problems.append(f"concurrency must be >= 1 for closed-loop arrivals, got {self.concurrency}")
        # Options that the chosen process ignores are contradictions, never silently dropped
        # (the defaults, rate 0, speed 1 and cv 1, mean "not given").
        if self.rate and self.mode not in ("poisson", "gamma"):
            problems.append(
                f"rate applies to poisson or gamma arrivals, not {self.mode}; add --arrival poisson"
            )
        if self.speed != 1.0 and self.mode != "recorded":
            problems.append(f"speed applies to recorded arrivals, not {self.mode}; use rate for {self.mode}")
        if self.cv != 1.0 and self.mode != "gamma":
            problems.append(
                f"cv applies to gamma arrivals, not {self.mode} (poisson gaps have cv 1); use --arrival gamma"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def open_loop(self) -> bool:
        return self.mode != "closed"

    def duration_s(self, recorded: list[float]) -> float | None:
        """How long the schedule lasts (the last send offset, in seconds); None when closed-loop
        (it lasts as long as the requests take)."""
        offsets = self.offsets(recorded)
        return None if offsets is None else max(offsets, default=0.0)

    def offsets(self, recorded: list[float]) -> list[float] | None:
        """Send offsets for requests recorded at ``recorded`` seconds; None when closed-loop."""
        n = len(recorded)
        if self.mode == "recorded":
            return [t / self.speed for t in recorded]
        if self.mode == "closed":
            return None
        rng = random.Random(self.seed)
        if self.mode == "poisson":
            gaps = [rng.expovariate(self.rate) for _ in range(n)]
        else:
            shape = 1.0 / (self.cv**2)
            gaps = [rng.gammavariate(shape, 1.0 / (self.rate * shape)) for _ in range(n)]
        out, t = [], 0.0
        for i, gap in enumerate(gaps):
            out.append(t)
            if i + 1 < n:
                t += gap
        return out
