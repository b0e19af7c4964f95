"""Progress of a long command (a replay, a spool flush, a rollup build) for the operator
watching it: done/total, rate, elapsed time and ETA, drawn on stderr.

The formatting is pure (``format_duration``, ``progress_line``); ``Progress`` decides when to
draw: on a terminal it redraws one line in place at most once per ``tty_interval_s``; otherwise
(a log file, a pipe) it writes a plain line at most once per ``plain_interval_s``, and always
when the state changes and at the end, so a log holds a few lines, not thousands.

The rate and ETA count from the first update, not from zero: a command that attaches to work
already under way (a flush of a half-drained spool) does not claim that work as its own speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

BAR_WIDTH = 24


def format_duration(seconds: float | None) -> str:
    """7 -> '7s'; 185 -> '3m05s'; 3725 -> '1h02m'; 90061 -> '25h01m'; None or inf -> '?'."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(per_second: float | None, unit: str) -> str:
    """1234.5 -> '1234 samples/s' (whole units from 100 up); 35.25 -> '35.2 samples/s'; None -> '? samples/s'."""
    if per_second is None or not math.isfinite(per_second):
        return f"? {unit}/s"
    if per_second >= 100:
        return f"{per_second:.0f} {unit}/s"
    return f"{per_second:.3g} {unit}/s"


def rate(done_delta: float, elapsed_s: float) -> float | None:
    """Units per second, or None while nothing can be said (no time passed yet)."""
    if elapsed_s <= 0:
        return None
    return max(0.0, done_delta) / elapsed_s


def eta(done: float, total: float | None, per_second: float | None) -> float | None:
    """Seconds left at ``per_second``: 0 when done, None when unknown (no total, no rate yet,
    or nothing moved)."""
    if total is None:
        return None
    left = total - done
    if left <= 0:
        return 0.0
    if not per_second:
        return None
    return left / per_second


def progress_line(
    done: int,
    total: int | None,
    elapsed_s: float,
    per_second: float | None,
    *,
    unit: str = "items",
    state: str = "",
    bar: bool = True,
) -> str:
    """One line: '[#######.....] 120/300 samples 40%  35.2 samples/s  elapsed 3s  ETA 5s  running'.

    ``total`` None (not known yet) leaves out the bar, the percentage and the ETA; a total of 0
    is complete. ``bar`` False for plain log lines."""
    parts = []
    if total is None:
        parts.append(f"{done} {unit}")
    else:
        fraction = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
        if bar:
            filled = int(BAR_WIDTH * fraction)
            parts.append(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]")
        parts.append(f"{done}/{total} {unit} {fraction:.0%}")
    parts.append(format_rate(per_second, unit))
    parts.append(f"elapsed {format_duration(elapsed_s)}")
    if total is not None:
        parts.append(f"ETA {format_duration(eta(done, total, per_second))}")
    if state:
        parts.append(state)
    return "  ".join(parts)


class Progress:
    """Draws progress lines through ``write`` (text, no newline added) and ``flush``.

    ``update(done, total, state)`` as often as convenient; ``finish(...)`` once at the end (it
    always draws, and ends a terminal's line). ``enabled`` False draws nothing."""

    def __init__(
        self,
        write: Callable[[str], None],
        flush: Callable[[], None] = lambda: None,
        *,
        tty: bool,
        enabled: bool = True,
        unit: str = "items",
        tty_interval_s: float = 1.0,
        plain_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._write, self._flush, self._clock = write, flush, clock
        self.tty, self.enabled, self.unit = tty, enabled, unit
        self.interval_s = tty_interval_s if tty else plain_interval_s
        self._start: tuple[float, int] | None = None  # (time, done) of the first update
        self._last_draw: float | None = None
        self._last_state: str | None = None
        self._last_drawn: tuple | None = None  # what the last line showed
        self._width = 0  # of the line drawn last on a terminal (to blank what is left of it)
        self.lines = 0  # lines drawn, for tests and for ``finish`` on a terminal

    def line(self, done: int, total: int | None, state: str = "") -> str:
        now = self._clock()
        if self._start is None:
            self._start = (now, done)
        t0, done0 = self._start
        elapsed = now - t0
        return progress_line(
            done, total, elapsed, rate(done - done0, elapsed), unit=self.unit, state=state, bar=self.tty
        )

    def update(
        self, done: int, total: int | None, state: str = "", *, detail: str = "", force: bool = False
    ) -> bool:
        """Draw if the interval has passed, the state changed, or ``force``; True if drawn.
        ``detail`` is shown after the state but is no reason to draw (it moves all the time)."""
        if not self.enabled:
            return False
        now = self._clock()
        due = (
            force
            or self._last_draw is None
            or state != self._last_state
            or now - self._last_draw >= self.interval_s
        )
        if not due:
            return False
        text = self.line(done, total, ", ".join(x for x in (detail, state) if x))
        self._last_draw, self._last_state, self._last_drawn = now, state, (done, total, state, detail)
        if self.tty:
            pad = max(0, self._width - len(text))
            self._write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self._write(text + "\n")
        self.lines += 1
        self._flush()
        return True

    def finish(self, done: int, total: int | None, state: str = "", *, detail: str = "") -> None:
        """The last line, drawn whatever the interval; a terminal's line is ended."""
        if not self.enabled:
            return
        if self._last_drawn != (done, total, state, detail):  # else that line is on screen already
            self.update(done, total, state, detail=detail, force=True)
        if self.tty:
            self._write("\n")
            self._flush()
