"""Traffic sources: the Azure production trace format and abplat's own JSONL log. Pure.

Both yield ``TraceRequest`` in file order with arrival offsets in seconds from the first
request. Problems are reported with their line numbers and fields; ``on_error`` chooses between
rejecting the whole source before anything is sent ("reject") and skipping bad lines while
counting them ("skip").

Sources are untrusted input, read as a stream: only regular files are opened (never a device,
FIFO, socket or /proc or /sys file), at most the size the file declared is read, lines longer
than a cap are refused, reading stops at ``limit`` requests, and a message quotes the file
only in a short escaped excerpt (``excerpt``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from replay.users import UserPopulation

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_TOKENS_LIMIT = 1_000_000
EXCERPT_MAX = 80  # characters of a source a message may quote, quotes and "..." included
REJECT_AFTER = 100  # malformed lines read before a rejected source stops being read
PSEUDO_ROOTS = ("/proc", "/sys")  # kernel files: regular by stat, yet no trace or log


def excerpt(value: str | bytes, limit: int = EXCERPT_MAX) -> str:
    """Untrusted text as a message may quote it: repr-like in single quotes, control and
    non-printable characters escaped (``\\n``, ``\\x00``, ``\\u2028``), cut with ``...`` to at
    most ``limit`` characters in all."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    out, used = [], 2  # the quotes
    for i, ch in enumerate(value):
        if ch == "\\" or ch == "'":
            piece = "\\" + ch
        elif ch.isprintable():
            piece = ch
        else:
            piece = ch.encode("unicode_escape").decode("ascii")
        rest = len(value) - i - 1
        if used + len(piece) + (3 if rest else 0) > limit:
            out.append("...")
            break
        out.append(piece)
        used += len(piece)
    return "'" + "".join(out) + "'"


def _plain_name(name: str) -> str:
    """A field name from the source: as it is when it looks like one, else an excerpt."""
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,39}", name) else excerpt(name, 40)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    seq: int  # position in the source, 0-based; part of the request's deterministic id
    offset_s: float  # recorded arrival, seconds after the first request
    user_id: str
    prompt_tokens: int  # wanted prompt length (azure), or 0 when the text is given
    max_tokens: int
    messages: tuple[dict, ...] | None = None  # chat text given by a JSONL log
    prompt: str | None = None  # completions text given by a JSONL log
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    line: int = 0  # line number in the source (1-based), for messages naming a request; 0: unknown


@dataclasses.dataclass(frozen=True)
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class SourceError(ValueError):
    def __init__(self, source: str, problems: list[Problem], *, stopped: bool = False):
        self.source = source
        self.problems = problems
        shown = "; ".join(str(p) for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        count = f"at least {len(problems)}" if stopped else str(len(problems))  # stopped reading early
        super().__init__(f"{source}: {count} malformed line(s): {shown}{more}")


class SourceFileError(SourceError):
    """The source file itself cannot be read (missing, a directory, not a regular file, too
    large, unreadable, not UTF-8): not a malformed line, so the message names the path and what
    is wrong with it."""

    def __init__(self, path: str | Path, reason: str):
        self.source, self.problems = str(path), []
        ValueError.__init__(self, f"{path}: cannot read: {reason}")


@dataclasses.dataclass
class LoadedSource:
    requests: list[TraceRequest]
    skipped: list[Problem]
    format: str
    read: int = 0  # requests read (after ``limit``, before thinning)


@dataclasses.dataclass(frozen=True)
class SourceSummary:
    """What a whole source holds, counted without keeping its requests (``summarize``)."""

    format: str
    rows: int  # requests (valid lines)
    span_s: float  # seconds from the earliest to the latest recorded arrival
    skipped: int  # malformed lines skipped (on_error="skip")

    @property
    def rate(self) -> float | None:
        """Mean requests per second over the span; None for a span of 0 (one instant)."""
        return self.rows / self.span_s if self.span_s > 0 else None


# ---- reading a file: regular files only, bounded in size and line length ----


def open_source(path: str | Path, *, max_bytes: int | None = None) -> tuple[BinaryIO, int]:
    """Open a trace or log for reading: (binary file, bytes to read at most). Refuses, before
    reading a byte, anything but a regular file (devices such as /dev/zero, FIFOs, sockets,
    directories, /proc and /sys files) and a file over ``max_bytes``."""
    path = Path(path)
    # 1. What the path is, following symlinks (a link to a device is a device).
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceFileError(path, "no such file (the path as this process sees it)") from None
    except OSError as exc:
        raise SourceFileError(path, exc.strerror or str(exc)) from None
    if stat.S_ISDIR(st.st_mode):
        raise SourceFileError(path, "a directory, not a trace or log file")
    if not stat.S_ISREG(st.st_mode):
        raise SourceFileError(path, "not a regular file (a device, FIFO or socket), not a trace or log file")
    real = os.path.realpath(path)
    if any(real == root or real.startswith(root + "/") for root in PSEUDO_ROOTS):
        raise SourceFileError(path, "a kernel file (/proc, /sys), not a trace or log file")
    # 2. Open without blocking (a FIFO swapped in meanwhile must not hang us) and check the
    # opened file again: the path may have changed between the stat and the open.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise SourceFileError(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceFileError(
                path, "not a regular file (a device, FIFO or socket), not a trace or log file"
            )
        if st.st_size == 0:
            raise SourceFileError(path, "empty (0 bytes)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise SourceFileError(path, f"{st.st_size} bytes, over the size cap of {max_bytes} bytes")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def iter_lines(fh: BinaryIO, budget: int, *, name: str, max_line_bytes: int | None = None) -> Iterator[str]:
    """The file's lines as text (line endings kept), reading at most ``budget`` bytes and one
    line at a time: a line over ``max_line_bytes`` (its newline not counted) stops the reading
    with an error naming it, and so does text that is not UTF-8."""
    lineno = 0
    while budget > 0:
        cap = budget if max_line_bytes is None else min(budget, max_line_bytes + 1)
        raw = fh.readline(cap)
        if not raw:
            return
        lineno += 1
        budget -= len(raw)
        body = raw[:-1] if raw.endswith(b"\n") else raw
        if max_line_bytes is not None and len(body) > max_line_bytes:
            problem = Problem(lineno, f"longer than {max_line_bytes} bytes (the line-length cap)")
            raise SourceError(name, [problem])
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceFileError(name, f"not UTF-8 text ({exc.reason} at line {lineno})") from None


# ---- parsing lines ----


def _parse_azure_time(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> epoch seconds, exactly."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    try:
        if frac and not (frac.isascii() and frac.isdigit()):
            raise ValueError
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    except (ValueError, OverflowError):
        raise ValueError(
            f"TIMESTAMP must be a time like 2023-11-16 18:17:03.9799600, got {excerpt(text)}"
        ) from None
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _positive_int(value: str, field: str, *, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    wanted = f"{field} must be a whole number in [{low}, {MAX_TOKENS_LIMIT}]"
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise ValueError(f"{wanted}, got {excerpt(value)}")
    number = int(text)
    if number < low or number > MAX_TOKENS_LIMIT:
        raise ValueError(f"{wanted}, got {number}")
    return number


def _finish(name: str, fmt: str, rows, problems, on_error: str) -> LoadedSource:
    if problems and on_error == "reject":
        raise SourceError(name, problems, stopped=_too_many(problems, on_error))
    if not rows:
        raise SourceError(name, problems or [Problem(0, "no requests in the source")])
    rows.sort(key=lambda r: (r[0], r[1]))  # by arrival, then file order (stable)
    first = rows[0][0]
    return LoadedSource([build(t - first) for t, _, build in rows], problems, fmt, read=len(rows))


def _too_many(problems: list[Problem], on_error: str) -> bool:
    # A rejected source is rejected whatever follows: stop reading it.
    return on_error == "reject" and len(problems) >= REJECT_AFTER


def _azure_rows(
    lines: Iterable[str], population: UserPopulation, name: str, problems: list[Problem], on_error: str
) -> Iterator[tuple]:
    """(arrival, seq, builder) per valid row; bad rows go to ``problems``."""
    it = iter(lines)
    header = next(it, "").strip().lstrip("\ufeff")
    if tuple(h.strip() for h in header.split(",")) != AZURE_HEADER:
        raise SourceError(
            name, [Problem(1, f"header must be {','.join(AZURE_HEADER)}, got {excerpt(header)}")]
        )
    seq = 0
    for lineno, line in enumerate(it, start=2):
        if not line.strip():
            continue
        parts = line.rstrip("\r\n").split(",")
        try:
            if len(parts) != 3:
                raise ValueError(
                    f"expected 3 comma-separated fields ({','.join(AZURE_HEADER)}), got {len(parts)}"
                )
            at = _parse_azure_time(parts[0])
            context = _positive_int(parts[1], "ContextTokens", allow_zero=False)
            generated = _positive_int(parts[2], "GeneratedTokens", allow_zero=False)
        except ValueError as exc:
            problems.append(Problem(lineno, str(exc)))
            if _too_many(problems, on_error):
                return
            continue
        user = population.user_for(seq)
        yield at, seq, _azure_builder(seq, user, context, generated, lineno)
        seq += 1


def read_azure(
    lines: Iterable[str],
    *,
    population: UserPopulation,
    name: str = "trace",
    on_error: str = "reject",
    limit: int | None = None,
) -> LoadedSource:
    """Rows ``TIMESTAMP,ContextTokens,GeneratedTokens`` with a header line; reading stops at
    ``limit`` valid rows."""
    _check_on_error(on_error)
    problems: list[Problem] = []
    rows = list(itertools.islice(_azure_rows(lines, population, name, problems, on_error), limit))
    return _finish(name, "azure", rows, problems, on_error)


def _azure_builder(seq: int, user: str, context: int, generated: int, line: int):
    return lambda offset: TraceRequest(seq, offset, user, context, generated, line=line)


def _check_on_error(on_error: str) -> None:
    if on_error not in ("reject", "skip"):
        raise ValueError(f"on_error must be 'reject' or 'skip', got {on_error!r}")


JSONL_TIME = "timestamp must be epoch seconds or an ISO 8601 string"


def _jsonl_time(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(JSONL_TIME)
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an integer past float's range (JSON allows 400 digits)
            raise ValueError("timestamp must be finite") from None
        if not math.isfinite(seconds):
            raise ValueError("timestamp must be finite")
        return seconds
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=UTC)
            return parsed.timestamp()
        except (ValueError, OverflowError):
            raise ValueError(f"{JSONL_TIME}, got {excerpt(value)}") from None
    raise ValueError(JSONL_TIME)


def _jsonl_messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have a string content")
        if m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise ValueError(f"messages[{i}].role must be system, user, assistant, tool or developer")
    return tuple(value)


JSONL_FIELDS = {"timestamp", "user_id", "messages", "prompt", "max_tokens", "metadata"}


def _jsonl_request(line: str, seq: int, population: UserPopulation) -> tuple[float, dict]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from None  # no echo of the line
    except RecursionError:
        raise ValueError("not JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    unknown = set(obj) - JSONL_FIELDS
    if unknown:
        names = sorted(unknown)
        shown = ", ".join(_plain_name(n) for n in names[:5]) + (
            f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        )
        raise ValueError(f"unknown field(s) {shown}")
    at = _jsonl_time(obj.get("timestamp"))
    has_messages, has_prompt = "messages" in obj, "prompt" in obj
    if has_messages == has_prompt:
        raise ValueError("give exactly one of messages (chat) or prompt (completions)")
    messages = _jsonl_messages(obj["messages"]) if has_messages else None
    prompt = obj.get("prompt")
    if has_prompt and (not isinstance(prompt, str) or not prompt):
        raise ValueError("prompt must be a non-empty string")
    max_tokens = obj.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError("max_tokens must be a whole number")
    max_tokens = _positive_int(str(max_tokens), "max_tokens", allow_zero=False)
    user = obj.get("user_id")
    if user is None:
        user = population.user_for(seq)
    elif not isinstance(user, str | int) or isinstance(user, bool) or str(user) == "":
        raise ValueError("user_id must be a non-empty string")
    elif isinstance(user, str) and any("\ud800" <= ch <= "\udfff" for ch in user):
        # JSON's "\ud800" escape: no UTF-8 form, so it can be neither hashed (assignment) nor stored.
        raise ValueError("user_id must be Unicode text: it holds a lone surrogate (\\ud800-\\udfff)")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata must be an object")
    return at, dict(
        seq=seq,
        user_id=str(user),
        prompt_tokens=0,
        max_tokens=max_tokens,
        messages=messages,
        prompt=prompt,
        metadata=metadata,
    )


def _jsonl_rows(
    lines: Iterable[str], population: UserPopulation, problems: list[Problem], on_error: str
) -> Iterator[tuple]:
    seq = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            at, req = _jsonl_request(line, seq, population)
        except ValueError as exc:
            problems.append(Problem(lineno, str(exc)))
            if _too_many(problems, on_error):
                return
            continue
        req["line"] = lineno
        yield at, seq, lambda offset, req=req: TraceRequest(offset_s=offset, **req)
        seq += 1


def read_jsonl(
    lines: Iterable[str],
    *,
    population: UserPopulation,
    name: str = "log",
    on_error: str = "reject",
    limit: int | None = None,
) -> LoadedSource:
    """abplat's traffic log: one JSON object a line (docs/replays.md, "Traffic logs"); reading stops
    at ``limit`` valid lines."""
    _check_on_error(on_error)
    problems: list[Problem] = []
    rows = list(itertools.islice(_jsonl_rows(lines, population, problems, on_error), limit))
    return _finish(name, "jsonl", rows, problems, on_error)


def _rows(
    fmt: str,
    lines: Iterable[str],
    population: UserPopulation,
    name: str,
    problems: list[Problem],
    on_error: str,
) -> Iterator[tuple]:
    if fmt == "azure":
        return _azure_rows(lines, population, name, problems, on_error)
    return _jsonl_rows(lines, population, problems, on_error)


def _check_format(fmt: str) -> None:
    if fmt not in ("azure", "jsonl"):
        raise ValueError(f"format must be azure or jsonl, got {fmt!r}")


def load_source(
    path: str | Path,
    fmt: str,
    *,
    population: UserPopulation,
    on_error: str = "reject",
    limit: int | None = None,
    max_bytes: int | None = None,
    max_line_bytes: int | None = None,
    name: str | None = None,
) -> LoadedSource:
    """The source's requests, read as a stream that stops after ``limit`` valid lines (the
    first ``limit`` in file order, then ordered by arrival), refusing a file over ``max_bytes``
    and a line over ``max_line_bytes``. ``name`` labels messages (default: the path)."""
    _check_format(fmt)
    _check_on_error(on_error)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    label = name or str(path)
    fh, size = open_source(path, max_bytes=max_bytes)
    problems: list[Problem] = []
    try:
        with fh:
            lines = iter_lines(fh, size, name=label, max_line_bytes=max_line_bytes)
            rows = list(itertools.islice(_rows(fmt, lines, population, label, problems, on_error), limit))
    except OSError as exc:
        raise SourceFileError(label, exc.strerror or str(exc)) from None
    return _finish(label, fmt, rows, problems, on_error)


def summarize(
    path: str | Path,
    fmt: str,
    *,
    on_error: str = "reject",
    max_bytes: int | None = None,
    max_line_bytes: int | None = None,
    name: str | None = None,
) -> SourceSummary:
    """Check a whole source and count it (requests, time span) without keeping its requests:
    memory stays flat however long the source is. Raises SourceError like ``load_source``."""
    _check_format(fmt)
    _check_on_error(on_error)
    label = name or str(path)
    fh, size = open_source(path, max_bytes=max_bytes)
    problems: list[Problem] = []
    rows, first, last = 0, math.inf, -math.inf
    try:
        with fh:
            lines = iter_lines(fh, size, name=label, max_line_bytes=max_line_bytes)
            for at, _seq, _build in _rows(fmt, lines, UserPopulation(size=1), label, problems, on_error):
                rows += 1
                first, last = min(first, at), max(last, at)
    except OSError as exc:
        raise SourceFileError(label, exc.strerror or str(exc)) from None
    if problems and on_error == "reject":
        raise SourceError(label, problems, stopped=_too_many(problems, on_error))
    if not rows:
        raise SourceError(label, problems or [Problem(0, "no requests in the source")])
    return SourceSummary(fmt, rows, last - first, len(problems))


def sniff_format(first_line: str | bytes) -> str | None:
    """'azure' for the Azure header, 'jsonl' for a JSON object, None for anything else."""
    if isinstance(first_line, bytes):
        first_line = first_line.decode("utf-8", "replace")
    text = first_line.strip().lstrip("\ufeff")
    if tuple(h.strip() for h in text.split(",")) == AZURE_HEADER:
        return "azure"
    if text.startswith("{"):
        return "jsonl"
    return None


def thin(requests: list[TraceRequest], fraction: float, seed: int = 0) -> list[TraceRequest]:
    """Keep each request with probability ``fraction``, decided by (seed, seq) alone: the same
    subset in every process, and the trace's burstiness kept at a lower rate (replaying a whole
    production service's traffic against one deployment per variant usually needs this)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return requests
    threshold = int(fraction * 2**64)
    return [r for r in requests if _uniform64(seed, r.seq) < threshold]


def _uniform64(seed: int, seq: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"thin:{seed}:{seq}".encode(), digest_size=8).digest(), "big")


def load_requests(
    source: str | Path,
    fmt: str,
    *,
    on_malformed: str = "reject",
    limit: int | None = None,
    seed: int = 0,
    sample_fraction: float = 1.0,
    max_bytes: int | None = None,
    max_line_bytes: int | None = None,
    name: str | None = None,
) -> LoadedSource:
    """A run's requests, exactly as every shard of it sees them: the source read with the
    run's user population (``seed``), cut to ``limit``, then thinned to ``sample_fraction``.
    Deterministic, so each shard (in any process) loads the same list and takes its share."""
    loaded = load_source(
        source,
        fmt,
        population=UserPopulation(seed=seed),
        on_error=on_malformed,
        limit=limit,
        max_bytes=max_bytes,
        max_line_bytes=max_line_bytes,
        name=name,
    )
    loaded.requests = thin(loaded.requests, sample_fraction, seed)
    return loaded
