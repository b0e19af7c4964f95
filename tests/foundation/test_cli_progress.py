"""Progress of long commands (telemetry.progress): the pure formatter, the throttle, and when
experiments.cli.JsonCommand draws it (a terminal, --progress, --no-progress)."""

import io

import pytest

from experiments.cli import JsonCommand
from telemetry.progress import Progress, eta, format_duration, format_rate, progress_line, rate


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (7.4, "7s"),
        (59.6, "1m00s"),
        (185, "3m05s"),
        (3599, "59m59s"),
        (3725, "1h02m"),
        (90061, "25h01m"),
        (-3, "0s"),
        (None, "?"),
        (float("inf"), "?"),
        (float("nan"), "?"),
    ],
)
def test_durations_read_at_a_glance(seconds, text):
    assert format_duration(seconds) == text


def test_rates_keep_three_figures_below_a_hundred_and_whole_units_above():
    assert format_rate(35.25, "samples") == "35.2 samples/s"
    assert format_rate(0.125, "runs") == "0.125 runs/s"
    assert format_rate(1234.4, "samples") == "1234 samples/s"
    assert format_rate(None, "files") == "? files/s"


def test_rate_and_eta_say_unknown_rather_than_guess():
    assert rate(10, 0) is None  # no time passed yet
    assert rate(10, 4) == 2.5
    assert rate(-5, 2) == 0.0  # a counter that went back (a reset) is no negative speed
    assert eta(10, 100, 2.0) == 45.0
    assert eta(10, None, 2.0) is None  # no total
    assert eta(10, 100, None) is None and eta(10, 100, 0.0) is None  # nothing moved yet
    assert eta(100, 100, None) == 0.0 and eta(120, 100, 1.0) == 0.0  # done (or past it)


def test_a_progress_line_has_count_share_rate_elapsed_and_eta():
    line = progress_line(120, 300, 3.4, 35.2, unit="samples", state="running")
    assert line == (
        "[#########...............]  120/300 samples 40%  35.2 samples/s  elapsed 3s  ETA 5s  running"
    )
    assert progress_line(120, 300, 3.4, 35.2, unit="samples", bar=False).startswith("120/300 samples 40%")
    # no total yet: no bar, share or ETA
    assert progress_line(7, None, 61, None, unit="files") == "7 files  ? files/s  elapsed 1m01s"
    # an empty job is complete; more done than planned never draws past 100%
    assert "0/0 runs 100%" in progress_line(0, 0, 0, None, unit="runs", bar=False)
    over = progress_line(12, 10, 1, 12.0, unit="x")
    assert over.startswith("[" + "#" * 24 + "]  12/10 x 100%") and "ETA 0s" in over


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def drawn(tty: bool, **kw):
    out, clock = io.StringIO(), Clock()
    p = Progress(out.write, tty=tty, unit="samples", clock=clock, **kw)
    return p, out, clock


def test_plain_lines_are_throttled_to_one_per_interval_but_a_new_state_and_the_end_always_draw():
    p, out, clock = drawn(tty=False, plain_interval_s=10.0)
    assert p.update(0, 100, "running")  # the first update draws
    clock.now += 5
    assert not p.update(50, 100, "running", detail="60 sent")  # within 10 s, detail is no reason
    clock.now += 5
    assert p.update(60, 100, "running")  # 10 s passed
    clock.now += 1
    assert p.update(70, 100, "flushing")  # the state changed
    clock.now += 1
    p.finish(100, 100, "done")
    lines = out.getvalue().splitlines()
    assert len(lines) == p.lines == 4 and out.getvalue().endswith("\n")
    assert lines[0] == "0/100 samples 0%  ? samples/s  elapsed 0s  ETA ?  running"
    assert lines[1] == "60/100 samples 60%  6 samples/s  elapsed 10s  ETA 7s  running"
    assert lines[-1] == "100/100 samples 100%  8.33 samples/s  elapsed 12s  ETA 0s  done"
    assert "\r" not in out.getvalue()


def test_a_terminal_redraws_one_line_in_place_and_blanks_what_a_longer_line_left():
    p, out, clock = drawn(tty=True, tty_interval_s=1.0)
    p.update(0, 10, "running a long state name")
    clock.now += 0.5
    assert not p.update(5, 10, "running a long state name")  # within the second
    clock.now += 0.5
    p.update(5, 10, "running a long state name")
    clock.now += 1
    p.finish(10, 10, "done")
    text = out.getvalue()
    draws = text.split("\r")[1:]
    assert len(draws) == 3 and text.endswith("\n") and text.count("\n") == 1
    assert draws[1].startswith("[" + "#" * 12 + "." * 12 + "]  5/10 samples 50%  5 samples/s")
    assert len(draws[2].rstrip("\n")) == len(draws[1])  # padded over the longer line before it
    assert draws[2].rstrip().endswith("ETA 0s  done")


def test_the_rate_counts_from_the_first_update_not_from_zero():
    p, out, clock = drawn(tty=False, plain_interval_s=0.0)
    p.update(5000, 10000)  # attached to work half done
    clock.now += 10
    p.update(5100, 10000)
    assert (
        out.getvalue().splitlines()[1] == "5100/10000 samples 51%  10 samples/s  elapsed 10s  ETA 8m10s"
    )  # 4900 left at 10/s


def test_the_end_is_not_drawn_twice_when_the_last_update_showed_it_already():
    p, out, clock = drawn(tty=False)
    p.update(0, 10, "running")
    clock.now += 1
    p.update(10, 10, "done", detail="10 sent")  # a new state: drawn
    clock.now += 1
    p.finish(10, 10, "done", detail="10 sent")
    assert p.lines == 2 and out.getvalue().splitlines()[-1].endswith("10 sent, done")
    t, tty_out, _ = drawn(tty=True)
    t.update(10, 10, "done")
    t.finish(10, 10, "done")
    assert t.lines == 1 and tty_out.getvalue().endswith("done\n")  # the terminal's line is ended


def test_disabled_progress_draws_nothing():
    p, out, _ = drawn(tty=True, enabled=False)
    assert not p.update(1, 2)
    p.finish(2, 2)
    assert out.getvalue() == "" and p.lines == 0


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "stream, option, enabled, tty",
    [
        (io.StringIO, None, False, False),
        (io.StringIO, True, True, False),
        (Terminal, None, True, True),
        (Terminal, False, False, True),
    ],
    ids=["pipe", "pipe --progress", "terminal", "terminal --no-progress"],
)
def test_commands_draw_progress_on_a_terminal_or_when_asked(stream, option, enabled, tty):
    err = stream()
    command = JsonCommand(stderr=err)
    progress = command.progress({"progress": option}, unit="runs")
    assert (progress.enabled, progress.tty) == (enabled, tty)
    progress.finish(3, 3, "done")
    if enabled:
        # drawn as is: a terminal's stderr gets no error colouring around progress
        assert "3/3 runs 100%" in err.getvalue() and "\x1b[" not in err.getvalue()
    else:
        assert err.getvalue() == ""
