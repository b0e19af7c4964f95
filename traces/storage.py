"""Traces on disk: uploads stored under settings.TRACE_DIR by content hash, and references
(a trace's name or sha256, or a file name) resolved inside that directory only.

An upload is written to a hidden temporary file in TRACE_DIR, hashed and checked as it is
written, then renamed into place (atomic on one file system): a reader never sees a
half-written trace, and a name under TRACE_DIR always holds the content its hash says.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from replay.sources import SourceError, excerpt, sniff_format, summarize
from traces.models import Trace, validate_name

SHA256 = re.compile(r"^[0-9a-f]{64}$")
TEMP_PREFIX = ".upload-"  # hidden: never a name a replay can give (see resolve_file)


class TraceError(ValueError):
    """A trace that cannot be stored or found; ``field`` names the input at fault."""

    status = 400

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
        self.message = message


class TraceTooLarge(TraceError):
    status = 413

    def __init__(self, size: int | None = None):
        got = f"{size} bytes" if size is not None else "more"
        super().__init__("file", f"{got}, over the cap of {settings.TRACE_MAX_BYTES} bytes (TRACE_MAX_BYTES)")


def trace_dir() -> Path:
    path = Path(settings.TRACE_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _check_name(name: str, digest: str | None = None) -> None:
    try:
        validate_name(name)
    except ValidationError as exc:
        raise TraceError("name", f"{excerpt(name, 60)}: {exc.messages[0]}") from None
    if digest is not None and SHA256.match(name) and name != digest:
        raise TraceError("name", "a 64-hex-digit name would read as another trace's sha256")


def store(chunks: Iterable[bytes], *, name: str, fmt: str | None = None, user=None) -> tuple[Trace, bool]:
    """Store an uploaded trace: (its row, True) when new, (the existing row, False) when a trace
    with the same content exists (dedupe by sha256; its name is kept). Raises TraceError.

    1. Stream the chunks into a temporary file in TRACE_DIR, hashing them and counting bytes
       (over TRACE_MAX_BYTES: stop and refuse).
    2. Check and count the whole trace (replay.sources.summarize, streaming, line-length cap):
       rows, time span, mean rate. A malformed trace is refused with its line numbers.
    3. Record the row and rename the file to its hash in one transaction."""
    _check_name(name)
    if fmt is not None and fmt not in Trace.Format.values:
        raise TraceError("format", f"must be azure or jsonl, got {excerpt(fmt, 40)}")
    directory = trace_dir()
    cap = settings.TRACE_MAX_BYTES
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=".part")
    tmp = Path(tmp_name)
    try:
        # 1.
        digest, size, first = hashlib.sha256(), 0, b""
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if size > cap:
                    raise TraceTooLarge()
                if len(first) < 4096:
                    first += chunk[: 4096 - len(first)]
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        sha = digest.hexdigest()
        _check_name(name, sha)
        # 2.
        fmt = fmt or sniff_format(first.split(b"\n", 1)[0])
        if fmt is None:
            raise TraceError(
                "format",
                "not given and not recognized: the first line is neither the Azure header "
                "(TIMESTAMP,ContextTokens,GeneratedTokens) nor a JSON object",
            )
        existing = Trace.objects.filter(sha256=sha).first()
        if existing is not None:
            if not existing.path.is_file():
                os.replace(tmp, directory / sha)  # its file had gone: the same content again
            return existing, False
        try:
            summary = summarize(
                tmp, fmt, max_bytes=cap, max_line_bytes=settings.TRACE_MAX_LINE_BYTES, name=name
            )
        except SourceError as exc:
            raise TraceError("file", str(exc)) from None
        # 3.
        taken = Trace.objects.filter(name=name).first()
        if taken is not None:
            raise TraceError("name", f"{name} is taken by trace {taken.sha256[:12]}; choose another name")
        try:
            with transaction.atomic():
                trace = Trace.objects.create(
                    name=name,
                    sha256=sha,
                    size=size,
                    format=fmt,
                    rows=summary.rows,
                    span_s=summary.span_s,
                    rate=summary.rate,
                    uploaded_by=user if getattr(user, "pk", None) else None,
                )
                os.replace(tmp, directory / sha)
        except IntegrityError:
            # The same content or name committed by a concurrent upload meanwhile.
            existing = Trace.objects.filter(sha256=sha).first()
            if existing is not None:
                return existing, False
            raise TraceError("name", f"{name} is taken; choose another name") from None
        _fsync_dir(directory)
        return trace, True
    finally:
        tmp.unlink(missing_ok=True)


def store_file(path: str | Path, *, name: str | None = None, fmt: str | None = None, user=None):
    """Store a local file as a trace (the operator's shell: add_trace, the demo)."""
    path = Path(path)
    size = path.stat().st_size
    if size > settings.TRACE_MAX_BYTES:
        raise TraceTooLarge(size)

    def chunks():
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                yield chunk

    return store(chunks(), name=name or path.name, fmt=fmt, user=user)


def _fsync_dir(directory: Path) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def find(ref: str) -> Trace | None:
    """The trace a replay names: by sha256 (64 hex digits) or by name."""
    ref = ref.strip()
    if SHA256.match(ref.lower()):
        return Trace.objects.filter(sha256=ref.lower()).first()
    return Trace.objects.filter(name=ref).first()


def resolve_file(name: str, *, field: str = "source") -> Path:
    """A file inside TRACE_DIR named relative to it: no absolute path, no '..', no hidden
    part (uploads in progress), and after following symlinks still a regular file inside the
    directory. Anything else is a TraceError that names the input, never the file's content."""
    shown = excerpt(name, 60)
    if not name or "\x00" in name:
        raise TraceError(
            field, "give a trace's name or sha256 (GET /api/traces/) or a file in the trace directory"
        )
    if name.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", name):
        raise TraceError(
            field,
            f"{shown} is an absolute path; only traces in the trace directory can be replayed "
            "here: upload it (POST /api/traces/) and give its name",
        )
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        raise TraceError(field, f"{shown}: '..' is not allowed; name a file inside the trace directory")
    if any(part.startswith(".") for part in parts):
        raise TraceError(field, f"{shown}: hidden files are not traces")
    base = trace_dir()
    try:
        real = (base / Path(*parts)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise TraceError(field, f"no trace {shown} (GET /api/traces/ lists them)") from None
    if not real.is_relative_to(base):
        raise TraceError(field, f"{shown} leads out of the trace directory (a symlink); refused")
    if not real.is_file():
        raise TraceError(field, f"{shown} is not a regular file in the trace directory")
    return real


def resolve(ref: str, *, field: str = "trace") -> tuple[Path, Trace | None]:
    """A replay's trace: (its file, its row when it was uploaded). ``ref`` is an uploaded
    trace's name or sha256, or the name of a file inside TRACE_DIR."""
    trace = find(ref) if ref else None
    if trace is not None:
        return resolve_file(trace.sha256, field=field), trace
    path = resolve_file(ref, field=field)
    return path, Trace.objects.filter(sha256=path.name).first() if SHA256.match(path.name) else None


def delete(trace: Trace) -> None:
    """Remove a trace's row, and its file once that is committed."""
    path = trace.path
    trace.delete()
    transaction.on_commit(lambda: path.unlink(missing_ok=True))
