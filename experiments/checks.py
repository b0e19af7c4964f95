"""The variant egress settings, read strictly: the allowlist parsed at first use
and by a system check, so a bad entry stops ``manage.py check``/``migrate``/the workers with
the entry named, instead of failing one request at a time.

The secrets' bindings file (``_bindings.json`` in the secrets directory) and the default team's
name are checked here too.

``document_egress()`` is what the Django glue (API, admin, services) passes to the pure
document rules: the parsed allowlist and a resolver for host names that are not on it.
"""

from __future__ import annotations

import functools
import os
import socket
import stat

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from experiments.document import SLUG_RE, SLUG_RULE
from streaming.egress import (
    BINDINGS_FILE,
    SECRETS_SETTING,
    SETTING,
    Allowlist,
    EgressError,
    SecretError,
    parse_allowlist,
    read_bindings,
)


@functools.lru_cache(maxsize=8)
def _parsed(entries: tuple[str, ...]) -> Allowlist:
    try:
        return parse_allowlist(entries)
    except EgressError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def variant_allowlist() -> Allowlist:
    """settings.VARIANT_ALLOWED_HOSTS, parsed (ImproperlyConfigured naming a bad entry)."""
    entries = settings.VARIANT_ALLOWED_HOSTS
    if isinstance(entries, str):  # a bare string would be read as a list of characters
        raise ImproperlyConfigured(f"{SETTING}: must be a list of entries, got {entries!r}")
    return _parsed(tuple(entries))


def resolve_host(host: str) -> list[str]:
    """The addresses ``host`` resolves to now (validation; connections check again)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def document_egress() -> dict:
    """Keyword arguments of ``experiments.document.validate_document`` for the settings' rules."""
    return {"allow": variant_allowlist(), "resolve": resolve_host}


@checks.register(checks.Tags.security)
def check_variant_egress(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    found: list[checks.CheckMessage] = []
    try:
        variant_allowlist()
    except ImproperlyConfigured as exc:
        found.append(
            checks.Error(
                str(exc),
                hint="entries are host names, '*.domain' patterns, IP addresses or CIDR networks",
                id="abplat.E001",
            )
        )
    directory = settings.VARIANT_SECRETS_DIR
    if directory:
        try:
            mode = os.stat(directory).st_mode
        except OSError as exc:
            found.append(checks.Error(f"{SECRETS_SETTING}={directory!r}: {exc.strerror}", id="abplat.E002"))
        else:
            if not stat.S_ISDIR(mode):
                found.append(
                    checks.Error(f"{SECRETS_SETTING}={directory!r}: not a directory", id="abplat.E002")
                )
            elif mode & stat.S_IWOTH:
                found.append(
                    checks.Warning(
                        f"{SECRETS_SETTING}={directory!r}: anyone on the host can add or replace secrets",
                        hint="chmod o-w on the directory",
                        id="abplat.W001",
                    )
                )
            if stat.S_ISDIR(mode):
                found += _bindings_errors(directory)
    team = settings.DEFAULT_TEAM
    if team and not SLUG_RE.match(team):
        found.append(
            checks.Error(
                f"ABPLAT_DEFAULT_TEAM={team[:80]!r}: a team's name is {SLUG_RULE}",
                hint="or empty: role users join no team by themselves",
                id="abplat.E004",
            )
        )
    return found


def _bindings_errors(directory: str) -> list[checks.CheckMessage]:
    """The secrets' bindings (streaming/egress.py), read as every connection reads them: a bad
    file refuses every secret, so ``manage.py check`` (and migrate) reports it, naming the entry."""
    try:
        read_bindings(directory)
    except SecretError as exc:
        return [
            checks.Error(
                str(exc),
                hint=f'{BINDINGS_FILE} maps secret names to {{"hosts": [...], "teams": [...]}} (docs/security.md)',
                id="abplat.E003",
            )
        ]
    return []
