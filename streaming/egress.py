"""Where variant requests may go, and the rules for their credentials. Pure: no Django, no
network calls (the callers resolve names and open sockets; this module only decides).

The allowlist (``ABPLAT_VARIANT_ALLOWED_HOSTS``) holds three kinds of entry:

- a host name, ``vllm-a.internal``: that name exactly (case-insensitive, trailing dot ignored);
- a suffix pattern, ``*.serving.internal``: every name under that domain (not the domain itself);
- an IP network, ``10.20.0.0/16``, ``::1/128``, or one address, ``10.20.0.7``.

How a variant's host is judged, at validation and again at connect time:

1. A name on the list (exact or by suffix) is allowed whatever it resolves to: the operator
   vouched for that name, and for whoever controls its DNS.
2. An IP literal is allowed when it lies in a listed network.
3. Any other name is allowed only when every address it resolves to lies in a listed network.
   The connection then goes to one of exactly those checked addresses (the caller pins them),
   so DNS that answers differently a moment later (rebinding) cannot move it elsewhere.

IPv4-mapped IPv6 addresses (``::ffff:10.0.0.1``) are judged as the IPv4 address they carry.

Credentials never ride in the URL: a variant names a secret (``auth: {secret: NAME}``), the
operator keeps its value in a file ``NAME`` of ``ABPLAT_VARIANT_SECRETS_DIR``, and the client
sends it as ``Authorization: Bearer <value>``. The value is never stored, logged or shown.

Whoever writes a document chooses the secret's name and the endpoint, so the operator also says
where each secret may go: ``_bindings.json`` in the same directory maps a secret's name to the
hosts it may be sent to and the teams whose experiments may use it::

    {"vllm-a-key": {"hosts": ["vllm-a.internal", "*.a.serving.internal", "10.20.0.0/16"],
                    "teams": ["search"]},
     "shared-key": {"hosts": ["gpu-pool.internal"], "teams": ["*"]}}

Hosts are judged as written in the endpoint URL: names and ``*.domain`` patterns match names, IP
networks match IP addresses (a name never matches a network: DNS does not move a token). A
secret with no binding is refused. ``bound_bearer`` is the one way to a connection's
Authorization: it reads the secret and refuses unless its binding allows the URL's host and the
experiment's team. The file is read at each use, like the secrets, so a change takes effect at
the next connection (the gateway: its next refresh). Its name cannot be a secret's: those start
with a letter or digit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import os
import re
import socket
import stat
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlsplit

SETTING = "ABPLAT_VARIANT_ALLOWED_HOSTS"
SECRETS_SETTING = "ABPLAT_VARIANT_SECRETS_DIR"
# Starts with a letter or digit: no ".", "..", and no hidden entries (Kubernetes keeps its
# "..data" bookkeeping next to the secret files of a mounted volume).
SECRET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SECRET_NAME_RULE = "letters, digits, '_', '.' and '-', starting with a letter or digit (max 64)"
SECRET_MAX_BYTES = 8192
BINDINGS_FILE = "_bindings.json"
BINDINGS_MAX_BYTES = 1024 * 1024
BINDING_FIELDS = ("hosts", "teams")
ANY_TEAM = "*"
# A team's name as experiments.models.Team and the documents take it (experiments/document.py,
# SLUG_RE): repeated here, since this module sits below the experiments app.
TEAM_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
_LABEL_RE = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")  # "_": container service names

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class EgressError(ValueError):
    """A URL or an allowlist entry that the rules reject (validation, configuration)."""


class EgressRefused(Exception):
    """A connection the allowlist refuses, decided after name resolution. Our side refused to
    send: the replay records it as a client error, never as the server's fault."""


class SecretError(ValueError):
    """A named secret that cannot be used. The message names the secret, never its value."""


@dataclasses.dataclass(frozen=True)
class Allowlist:
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".serving.internal" for "*.serving.internal"
    networks: tuple[IPNetwork, ...] = ()

    def allows_name(self, host: str) -> bool:
        host = normalize_host(host)
        return host in self.names or any(host.endswith(s) for s in self.suffixes)

    def allows_address(self, address: str | IPAddress) -> bool:
        ip = _unmapped(ipaddress.ip_address(address) if isinstance(address, str) else address)
        return any(ip in net for net in self.networks)

    def describe(self) -> str:
        parts = sorted(self.names) + [f"*{s}" for s in self.suffixes] + [str(n) for n in self.networks]
        return ", ".join(parts) or "(empty: nothing allowed)"


def normalize_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _unmapped(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def ip_literal(host: str) -> IPAddress | None:
    """The address when ``host`` is an IP literal (brackets and IPv6 zone ignored), else None."""
    text = host.strip().strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL_RE.match(label) for label in name.split("."))


def parse_allowlist(entries: Iterable[str], setting: str = SETTING) -> Allowlist:
    """The allowlist from its entries; EgressError naming every bad entry and why."""
    if isinstance(entries, str):
        raise EgressError(f"{setting}: must be a list of entries, got the string {entries!r}")
    names: set[str] = set()
    suffixes: list[str] = []
    networks: list[IPNetwork] = []
    problems: list[str] = []
    for raw in entries:
        entry = raw.strip() if isinstance(raw, str) else raw
        if not isinstance(entry, str) or not entry:
            problems.append(f"{raw!r}: an empty entry")
            continue
        if "/" in entry or ip_literal(entry) is not None:
            try:
                networks.append(ipaddress.ip_network(entry, strict=True))
            except ValueError as exc:
                problems.append(f"{entry!r}: not an IP address or CIDR network ({exc})")
            continue
        name = normalize_host(entry)
        if name.startswith("*."):
            if not _valid_name(name[2:]) or "." not in name[2:]:
                problems.append(f"{entry!r}: a suffix pattern is '*.' and a domain of two labels or more")
            else:
                suffixes.append(name[1:])
            continue
        if not _valid_name(name):
            problems.append(
                f"{entry!r}: not a host name (letters, digits, '-', '_' in dot-separated labels), "
                "a '*.domain' pattern, an IP address or a CIDR network"
            )
            continue
        names.add(name)
    if problems:
        raise EgressError(f"{setting}: " + "; ".join(problems))
    return Allowlist(frozenset(names), tuple(dict.fromkeys(suffixes)), tuple(dict.fromkeys(networks)))


@dataclasses.dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as in the URL, lowercased, without brackets
    port: int


def split_url(url: str) -> Target:
    """Scheme, host and port of a variant URL; EgressError for anything but a plain
    http(s) URL, and for credentials in it (``user:key@host``)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise EgressError("must be a valid http(s) URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EgressError("must be an http:// or https:// URL with a host")
    if "@" in parts.netloc:
        raise EgressError(
            "must not carry credentials (user:password@host): name a secret with "
            "auth: {secret: NAME} instead, whose value the operator keeps out of the database"
        )
    return Target(parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80))


def check_addresses(host: str, addresses: Sequence[str], allow: Allowlist) -> list[str]:
    """Connect time: the addresses ``host`` resolved to that may be dialled (all of them, in
    order), or EgressRefused. ``addresses`` for an IP literal is the literal itself."""
    if not addresses:
        raise EgressRefused(f"host {host!r} resolved to no address")
    literal = ip_literal(host)
    if literal is None and allow.allows_name(host):
        return list(addresses)
    outside = [a for a in addresses if not allow.allows_address(a)]
    if outside:
        what = "is" if literal is not None else f"resolves to {', '.join(outside)}, which is"
        raise EgressRefused(f"host {host!r} {what} outside the variant allowlist ({SETTING})")
    return list(addresses)


def _unique(addresses: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(addresses))


async def allowed_addresses(host: str, port: int, allow: Allowlist) -> list[str]:
    """The addresses of ``host`` the allowlist lets us dial, in resolution order, or
    EgressRefused. Resolution errors are the OSError (gaierror) of getaddrinfo."""
    literal = ip_literal(host)
    if literal is not None:
        return check_addresses(host, [str(literal)], allow)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return check_addresses(host, _unique([info[4][0] for info in infos]), allow)


def allowed_addresses_sync(host: str, port: int, allow: Allowlist) -> list[str]:
    literal = ip_literal(host)
    if literal is not None:
        return check_addresses(host, [str(literal)], allow)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return check_addresses(host, _unique([info[4][0] for info in infos]), allow)


def check_url(url: str, allow: Allowlist, resolve: Callable[[str], Sequence[str]] | None = None) -> Target:
    """Validation time: the URL's target, or EgressError saying what is wrong with it.

    A name that is not on the list is judged by what ``resolve`` answers for it now (the
    connection is checked again when it is made); without ``resolve`` it is rejected."""
    target = split_url(url)
    host = target.host
    literal = ip_literal(host)
    if literal is not None:
        if not allow.allows_address(literal):
            raise EgressError(f"host {host} is not in the variant allowlist ({SETTING})")
        return target
    if allow.allows_name(host):
        return target
    hint = f"add it to {SETTING} by name, or its addresses by network"
    if resolve is None or not allow.networks:
        raise EgressError(f"host {host!r} is not in the variant allowlist ({SETTING}): {hint}")
    try:
        addresses = list(resolve(host))
    except OSError:
        addresses = []
    if not addresses:
        raise EgressError(f"host {host!r} is not in the variant allowlist and does not resolve: {hint}")
    try:
        check_addresses(host, addresses, allow)
    except EgressRefused as exc:
        raise EgressError(f"{exc}: {hint}") from None
    return target


def check_secret_name(name: object) -> str:
    if not isinstance(name, str) or not SECRET_NAME_RE.match(name):
        raise SecretError(f"a secret name is {SECRET_NAME_RULE}, got {name!r}")
    return name


def token_from_bytes(name: str, data: bytes) -> str:
    """The bearer token a secret file holds: one line of printable ASCII (trailing newline
    and surrounding blanks ignored). Errors name the secret, never any of its bytes."""
    if len(data) > SECRET_MAX_BYTES:
        raise SecretError(f"secret {name!r} is larger than {SECRET_MAX_BYTES} bytes")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise SecretError(f"secret {name!r} is not ASCII text") from None
    if not token:
        raise SecretError(f"secret {name!r} is empty")
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        # A CR/LF would split the header; a blank would make it no longer a bearer token.
        raise SecretError(f"secret {name!r} must be one token of printable characters without blanks")
    return token


def read_secret(directory: str, name: str) -> str:
    """The token in file ``name`` of ``directory``. Regular files only (a symlink to one is
    fine: mounted Kubernetes secrets are symlinks); SecretError names the secret and the
    setting, never the value."""
    check_secret_name(name)
    if not directory:
        raise SecretError(f"secret {name!r}: no secrets directory is configured ({SECRETS_SETTING})")
    try:
        # O_NONBLOCK: a FIFO planted under the name must not hang the worker on open().
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SecretError(
            f"secret {name!r} is not configured (no file of that name in {SECRETS_SETTING})"
        ) from None
    except OSError as exc:
        raise SecretError(f"secret {name!r} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SecretError(f"secret {name!r} is not a regular file in {SECRETS_SETTING}")
        data = os.read(fd, SECRET_MAX_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"secret {name!r} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    return token_from_bytes(name, data)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- where each secret may go (the operator's _bindings.json) ---------------------------------

_WHERE = f"{BINDINGS_FILE} in {SECRETS_SETTING}"


def _shown(value: object, limit: int = 80) -> str:
    """A value of the operator's file in a message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Binding:
    """Where one secret may be sent (``hosts``, allowlist entries) and whose experiments may
    use it (``teams``; ANY_TEAM: every team)."""

    secret: str
    hosts: Allowlist
    teams: frozenset[str]

    def allows_host(self, host: str) -> bool:
        literal = ip_literal(host)
        if literal is not None:
            return self.hosts.allows_address(literal)
        return self.hosts.allows_name(host)

    def allows_team(self, team: str) -> bool:
        return ANY_TEAM in self.teams or team in self.teams


def parse_bindings(data: bytes | str) -> dict[str, Binding]:
    """The bindings in the text of the bindings file; SecretError naming every bad entry and
    field (the file is the operator's, but a mistake in it must say where it is)."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise SecretError(f"{_WHERE}: not valid JSON{where}") from None
    if not isinstance(raw, dict):
        raise SecretError(
            f'{_WHERE}: must be a JSON object of secret names, {{"NAME": {{"hosts": [...], ...}}}}'
        )
    bindings: dict[str, Binding] = {}
    problems: list[str] = []
    for name, entry in raw.items():
        if not SECRET_NAME_RE.match(name):
            problems.append(f"{_shown(name)}: not a secret name ({SECRET_NAME_RULE})")
            continue
        label = repr(name)
        if not isinstance(entry, dict):
            problems.append(f'{label}: must be an object, {{"hosts": [HOST, ...], "teams": [TEAM, ...]}}')
            continue
        for field in sorted(set(entry) - set(BINDING_FIELDS)):
            shown = field if field.isprintable() and len(field) <= 40 else _shown(field, 40)
            problems.append(f"{label}.{shown}: unknown field; allowed: {', '.join(BINDING_FIELDS)}")
        hosts = entry.get("hosts")
        allow = None
        if not isinstance(hosts, list) or not hosts:
            problems.append(
                f"{label}.hosts: must be a non-empty list of host names, '*.domain' patterns, "
                "IP addresses or CIDR networks"
            )
        else:
            try:
                allow = parse_allowlist(hosts, setting=f"{label}.hosts")
            except EgressError as exc:
                problems.append(str(exc))
        teams = entry.get("teams")
        if not isinstance(teams, list) or not teams:
            problems.append(
                f'{label}.teams: must be a non-empty list of team names, or ["{ANY_TEAM}"] for every team'
            )
            teams = None
        else:
            bad = [t for t in teams if t != ANY_TEAM and not (isinstance(t, str) and TEAM_NAME_RE.match(t))]
            if bad:
                problems.append(
                    f"{label}.teams: {', '.join(_shown(t, 40) for t in bad[:5])}: a team's name is lowercase "
                    f"letters, digits and '-' (as in the admin's Teams), or \"{ANY_TEAM}\" for every team"
                )
                teams = None
        if allow is not None and teams is not None:
            bindings[name] = Binding(name, allow, frozenset(teams))
    if problems:
        raise SecretError(f"{_WHERE}: " + "; ".join(problems))
    return bindings


def read_bindings(directory: str) -> dict[str, Binding]:
    """The bindings file of the secrets ``directory``, parsed: {} when there is none (then no
    secret may be sent), SecretError when it cannot be read or is invalid. Read like a secret:
    a regular file (a symlink to one is fine), never a FIFO that would hang the reader."""
    if not directory:
        raise SecretError(f"no secrets directory is configured ({SECRETS_SETTING})")
    try:
        fd = os.open(os.path.join(directory, BINDINGS_FILE), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise SecretError(f"{_WHERE} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SecretError(f"{_WHERE} is not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > BINDINGS_MAX_BYTES:
                raise SecretError(f"{_WHERE} is larger than {BINDINGS_MAX_BYTES} bytes")
            chunks.append(chunk)
    except OSError as exc:
        raise SecretError(f"{_WHERE} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    return parse_bindings(b"".join(chunks))


def binding_refusal(
    bindings: dict[str, Binding], name: str, host: str, team: str, *, advise: bool = False
) -> str | None:
    """Why secret ``name`` may not go to ``host`` for an experiment of ``team``, or None.

    ``advise`` (a document being saved, read by its author): an unbound secret's message shows
    the entry the operator would add, and a refused host the hosts the binding allows. Without it
    (a connection, whose error may reach a gateway's caller) neither is shown. A refused team never
    shows which teams the binding names."""
    binding = bindings.get(name)
    if binding is None:
        fix = ""
        if advise:
            entry = json.dumps({name: {"hosts": [host], "teams": [team]}})
            fix = f": the operator adds it, e.g. {entry}, before a variant may use it"
        return (
            f"secret {name!r} is not bound to any host ({_WHERE} lists where each secret may be sent "
            f"and for which teams){fix}"
        )
    if not binding.allows_team(team):
        return f"secret {name!r} is not bound to team {team!r}: the operator's {_WHERE} says which teams may use it"
    if not binding.allows_host(host):
        allowed = f"; it may be sent to {binding.hosts.describe()}" if advise else ""
        return f"secret {name!r} is not bound to host {host!r} ({_WHERE}){allowed}"
    return None


def bound_bearer(directory: str, name: str, *, url: str, team: str) -> dict[str, str]:
    """The Authorization header of secret ``name`` for a connection to ``url`` made for an
    experiment of ``team``: the one place a secret's value is read for sending. SecretError
    (naming the secret, the host or the team, never the value) when the secret cannot be read or
    its binding does not allow this host or team."""
    check_secret_name(name)
    try:
        host = split_url(url).host
    except EgressError as exc:
        raise SecretError(f"secret {name!r} is not sent: the endpoint {exc}") from None
    token = read_secret(directory, name)
    refusal = binding_refusal(read_bindings(directory), name, host, team)
    if refusal is not None:
        raise SecretError(refusal)
    return bearer(token)
