"""The metrics settings checked: the multiprocess directory and who may read ``/metrics``.

Plain functions of the values given, stdlib only, and nothing done at import: abplat/config.py
(``settings_from``) checks ABPLAT_METRICS_DIR, ABPLAT_METRICS_ALLOWED_CIDRS and
ABPLAT_METRICS_TOKEN_FILE with them, so loading settings (or testing them on a dict) never
chooses the process's metrics mode. telemetry/metrics.py fixes that mode with
``multiprocess_dir(os.environ)`` when it is first imported (its docstring says why then), which
is at app start in every process (workers/apps.py, configure_metrics); docs/metrics.md says what
each variable means.

Each error is a ``MetricsConfigError`` whose message is one line naming the variable.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import tempfile
from collections.abc import Mapping, Sequence

SETTING = "ABPLAT_METRICS_DIR"
# prometheus_client's own variable: abplat sets it from SETTING, never the other way round.
THEIRS = "PROMETHEUS_MULTIPROC_DIR"


class MetricsConfigError(Exception):
    """A metrics setting is not usable: ABPLAT_METRICS_DIR (or PROMETHEUS_MULTIPROC_DIR beside
    it), ABPLAT_METRICS_ALLOWED_CIDRS, ABPLAT_METRICS_TOKEN_FILE."""


# ---- the multiprocess directory -----------------------------------------------------------------


def check_dir(raw: str, name: str = SETTING) -> str:
    """``raw`` as an absolute directory this process can write (created if missing), or
    MetricsConfigError naming ``name`` and what is wrong. Writing is tried for real (a file
    created and removed): root passes every permission check, and a full disk or a file system
    that refuses what its permission bits allow fails only a write. App start runs it, through
    telemetry.metrics; settings check with ``check_dir_would_work``, which writes nothing."""
    path = os.path.abspath(os.path.expanduser(raw))
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise _not_a_directory(name, raw, path) from None
    except OSError as exc:
        raise _cannot_create(name, raw, path, exc.strerror) from None
    if not os.path.isdir(path):
        raise MetricsConfigError(f"Unexpected value {name}={raw!r}: {path} is not a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".abplat-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        refused = exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        raise _cannot_write(
            name, raw, path, "not writable by this process" if refused else exc.strerror
        ) from None
    return path


def check_dir_would_work(raw: str, name: str = SETTING) -> str:
    """``raw`` as the absolute directory ``check_dir`` would make and accept, judged by reading
    the disk only: nothing is made or written (settings load with it, abplat/config.py). The
    directory exists and this process may write in it, or it is missing and its nearest existing
    ancestor is a directory this process may write in; MetricsConfigError otherwise, with
    ``check_dir``'s messages. ``os.access`` answers as the kernel would for a write (a read-only
    file system refuses, root passes the permission bits); what only a real write shows is left
    to ``check_dir`` at app start."""
    path = os.path.abspath(os.path.expanduser(raw))
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if existing == path:
        if not os.path.isdir(path):
            raise _not_a_directory(name, raw, path)
        if not os.access(path, os.W_OK | os.X_OK):
            raise _cannot_write(name, raw, path, "not writable by this process")
        return path
    if not os.path.isdir(existing):
        raise _cannot_create(name, raw, path, os.strerror(errno.ENOTDIR))
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        raise _cannot_create(name, raw, path, os.strerror(errno.EROFS if read_only else errno.EACCES))
    return path


def _not_a_directory(name: str, raw: str, path: str) -> MetricsConfigError:
    return MetricsConfigError(f"Unexpected value {name}={raw!r}: {path} exists and is not a directory.")


def _cannot_create(name: str, raw: str, path: str, why: str) -> MetricsConfigError:
    return MetricsConfigError(f"Unexpected value {name}={raw!r}: cannot create the directory {path}: {why}.")


def _cannot_write(name: str, raw: str, path: str, what: str) -> MetricsConfigError:
    return MetricsConfigError(
        f"Unexpected value {name}={raw!r}: the directory {path} is {what} "
        f"(every web and worker process writes its metric files there)."
    )


def multiprocess_dir(environ: Mapping[str, str], *, make: bool = True) -> str:
    """The multiprocess directory ``environ`` asks for through ABPLAT_METRICS_DIR, checked, or ""
    for in-process metrics. ``make`` (app start, telemetry.metrics): ``check_dir``, which creates
    it if missing and writes to it; ``make=False`` (settings, abplat/config.py):
    ``check_dir_would_work``, which only reads the disk. PROMETHEUS_MULTIPROC_DIR alone, or naming
    another directory, is refused: prometheus_client would read one directory and abplat's scrape
    another."""
    raw = environ.get(SETTING, "").strip()
    theirs = environ.get(THEIRS, "").strip()
    if not raw:
        if theirs:
            raise MetricsConfigError(
                f"{THEIRS}={theirs!r} is set but {SETTING} is not: set {SETTING} to that directory "
                f"instead (abplat sets {THEIRS} from it), or unset both for in-process metrics."
            )
        return ""
    path = check_dir(raw) if make else check_dir_would_work(raw)
    if theirs and os.path.abspath(theirs) != path:
        raise MetricsConfigError(
            f"{SETTING}={raw!r} and {THEIRS}={theirs!r} name different directories: "
            f"unset {THEIRS} (abplat sets it from {SETTING})."
        )
    return path


# ---- who may read /metrics (abplat/metrics.py) --------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MIN_TOKEN_CHARS = 16


def parse_networks(items: Sequence[str], name: str) -> tuple[Network, ...]:
    """Networks ("10.0.0.0/8", "::1/128", or one address) from a setting's list; ``none`` alone
    means no network (a bearer token only). MetricsConfigError names the item."""
    if [i.lower() for i in items] == ["none"]:
        return ()
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise MetricsConfigError(
                f"Unexpected value {name} item {item!r}: use a network (10.0.0.0/8, ::1/128) or one "
                "address, comma-separated, or 'none' for a bearer token only."
            ) from None
    return tuple(out)


def read_token_file(path: str, name: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace ignored), at least MIN_TOKEN_CHARS
    characters; "" for an empty ``path`` (no token)."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise MetricsConfigError(f"Unexpected value {name}={path!r}: cannot read it: {exc}.") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token) or not token.isprintable():
        raise MetricsConfigError(
            f"Unexpected value {name}={path!r}: the file must hold one token of at least "
            f"{MIN_TOKEN_CHARS} printable characters without spaces."
        )
    return token


def address_allowed(address: str, networks: Sequence[Network]) -> bool:
    """Whether ``address`` (a peer address, IPv4-mapped IPv6 read as IPv4, a zone id ignored) is
    in one of ``networks``; False for anything that is not an address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)
