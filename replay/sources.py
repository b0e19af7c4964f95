"""Traffic sources: the Azure production trace format and abplat's own JSONL log. Pure.

Both yield ``TraceRequest`` in file order with arrival offsets in seconds from the first
request. Problems are reported with their line numbers; ``on_error`` chooses between
rejecting the whole source before anything is sent ("reject") and skipping bad lines while
counting them ("skip").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from replay.users import UserPopulation

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_TOKENS_LIMIT = 1_000_000


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
    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        shown = "; ".join(str(p) for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(f"{source}: {len(problems)} malformed line(s): {shown}{more}")


class SourceFileError(SourceError):
    """The source file itself cannot be read (missing, a directory, unreadable, not UTF-8):
    not a malformed line, so the message names the path and what is wrong with it."""

    def __init__(self, path: str | Path, reason: str):
        self.source, self.problems = str(path), []
        ValueError.__init__(self, f"{path}: cannot read: {reason}")


@dataclasses.dataclass
class LoadedSource:
    requests: list[TraceRequest]
    skipped: list[Problem]
    format: str


def _parse_azure_time(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> epoch seconds, exactly."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    if frac and not frac.isdigit():
        raise ValueError(f"bad fractional seconds {frac!r}")
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _positive_int(value: str, field: str, *, allow_zero: bool) -> int:
    number = int(value)
    if number < 0 or (number == 0 and not allow_zero) or number > MAX_TOKENS_LIMIT:
        low = 0 if allow_zero else 1
        raise ValueError(f"{field} must be a whole number in [{low}, {MAX_TOKENS_LIMIT}], got {value}")
    return number


def _finish(name: str, fmt: str, rows, problems, on_error: str) -> LoadedSource:
    if problems and on_error == "reject":
        raise SourceError(name, problems)
    if not rows:
        raise SourceError(name, problems or [Problem(0, "no requests in the source")])
    rows.sort(key=lambda r: (r[0], r[1]))  # by arrival, then file order (stable)
    first = rows[0][0]
    return LoadedSource([build(t - first) for t, _, build in rows], problems, fmt)


def read_azure(lines: Iterable[str], *, population: UserPopulation, name: str = "trace",
               on_error: str = "reject") -> LoadedSource:  # fmt: skip
    """Rows ``TIMESTAMP,ContextTokens,GeneratedTokens`` with a header line."""
    _check_on_error(on_error)
    rows, problems = [], []
    it = iter(lines)
    header = next(it, "").strip().lstrip("\ufeff")
    if tuple(h.strip() for h in header.split(",")) != AZURE_HEADER:
        raise SourceError(name, [Problem(1, f"header must be {','.join(AZURE_HEADER)}, got {header!r}")])
    seq = 0
    for lineno, line in enumerate(it, start=2):
        if not line.strip():
            continue
        parts = line.rstrip("\r\n").split(",")
        try:
            if len(parts) != 3:
                raise ValueError(f"expected 3 comma-separated fields, got {len(parts)}")
            at = _parse_azure_time(parts[0])
            context = _positive_int(parts[1], "ContextTokens", allow_zero=False)
            generated = _positive_int(parts[2], "GeneratedTokens", allow_zero=False)
        except ValueError as exc:
            problems.append(Problem(lineno, str(exc)))
            continue
        user = population.user_for(seq)
        rows.append((at, seq, _azure_builder(seq, user, context, generated, lineno)))
        seq += 1
    return _finish(name, "azure", rows, problems, on_error)


def _azure_builder(seq: int, user: str, context: int, generated: int, line: int):
    return lambda offset: TraceRequest(seq, offset, user, context, generated, line=line)


def _check_on_error(on_error: str) -> None:
    if on_error not in ("reject", "skip"):
        raise ValueError(f"on_error must be 'reject' or 'skip', got {on_error!r}")


def _jsonl_time(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("timestamp must be epoch seconds or an ISO 8601 string")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("timestamp must be finite")
        return float(value)
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.timestamp()
    raise ValueError("timestamp must be epoch seconds or an ISO 8601 string")


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


def read_jsonl(lines: Iterable[str], *, population: UserPopulation, name: str = "log",
               on_error: str = "reject") -> LoadedSource:  # fmt: skip
    """abplat's traffic log: one JSON object a line (see README, "Traffic logs")."""
    _check_on_error(on_error)
    rows, problems = [], []
    seq = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("each line must be a JSON object")
            unknown = set(obj) - JSONL_FIELDS
            if unknown:
                raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
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
            metadata = obj.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("metadata must be an object")
        except (ValueError, json.JSONDecodeError) as exc:
            problems.append(Problem(lineno, str(exc)))
            continue
        req = dict(seq=seq, user_id=str(user), prompt_tokens=0, max_tokens=max_tokens,
                   messages=messages, prompt=prompt, metadata=metadata, line=lineno)  # fmt: skip
        rows.append((at, seq, lambda offset, req=req: TraceRequest(offset_s=offset, **req)))
        seq += 1
    return _finish(name, "jsonl", rows, problems, on_error)


def load_source(path: str | Path, fmt: str, *, population: UserPopulation, on_error: str = "reject",
                limit: int | None = None) -> LoadedSource:  # fmt: skip
    path = Path(path)
    if fmt not in ("azure", "jsonl"):
        raise ValueError(f"format must be azure or jsonl, got {fmt!r}")
    # A missing or unreadable file is not a malformed line: say what is wrong with the path.
    if not path.exists():
        raise SourceFileError(path, "no such file (the path as this process sees it)")
    if path.is_dir():
        raise SourceFileError(path, "a directory, not a trace or log file")
    try:
        with path.open(encoding="utf-8", newline="") as fh:
            reader = read_azure if fmt == "azure" else read_jsonl
            loaded = reader(fh, population=population, name=str(path), on_error=on_error)
    except OSError as exc:
        raise SourceFileError(path, exc.strerror or str(exc)) from None
    except UnicodeDecodeError as exc:
        raise SourceFileError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        loaded.requests = loaded.requests[:limit]
    return loaded


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


def load_requests(source: str | Path, fmt: str, *, on_malformed: str = "reject", limit: int | None = None,
                  seed: int = 0, sample_fraction: float = 1.0) -> LoadedSource:  # fmt: skip
    """A run's requests, exactly as every shard of it sees them: the source read with the
    run's user population (``seed``), cut to ``limit``, then thinned to ``sample_fraction``.
    Deterministic, so each shard (in any process) loads the same list and takes its share."""
    loaded = load_source(
        source, fmt, population=UserPopulation(seed=seed), on_error=on_malformed, limit=limit
    )
    loaded.requests = thin(loaded.requests, sample_fraction, seed)
    return loaded
