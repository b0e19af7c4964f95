"""Which experiment, which user, which variant: the gateway's routing decisions (pure).

No Django, no network: the app hands in what the request said and the router's ``assign``;
this module decides. Every string that comes from a client is checked here, with an error that
names the field and says why (``RequestError``, which the app turns into an OpenAI-style error
body with its status).

1. Experiment: a configured route for the request's ``model`` wins, then the longest configured
   path prefix, then the ``model`` itself is the experiment key.
2. User: OpenAI's body field ``user``, else the configured header, else a hash of the API key;
   none of them: unassigned (served by the control, counted).
3. Variant: the router's assignment. The gateway serves running and paused experiments and
   the configured default one; one of those the router holds no weights for is served by its
   control. Any other name (unknown, a draft, a concluded experiment, or one the tenant may not
   reach) is served by the default experiment's control, or is a 404 ``model_not_found`` that
   does not say which of these it was.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

# Experiment keys are Django slugs (experiments.weights.document.KEY_RE).
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_PREFIX_RE = re.compile(r"^/[A-Za-z0-9._~/-]*$")
MAX_MODEL_CHARS = 256
MAX_USER_CHARS = 256
API_PATHS = ("/v1/chat/completions", "/v1/completions")
# A user id from an API key: versioned, so a change of the rule is a visible new prefix.
_KEY_USER_SALT = b"abplat-gateway-user-v1:"


class RequestError(ValueError):
    """A request the gateway refuses: HTTP status, OpenAI error type/code, the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind


class Reason(StrEnum):
    """Why a request got its variant (counted per reason)."""

    ASSIGNED = "assigned"  # the router's assignment
    UNASSIGNED = "unassigned"  # no user: the control
    NOT_RUNNING = "not_running"  # served experiment the router holds no weights for: control
    DEFAULT = "default"  # a name not served to this tenant: the default experiment's control


class UserSource(StrEnum):
    BODY = "body"
    HEADER = "header"
    API_KEY = "api_key"
    NONE = "none"


def check_text(value: object, field: str, max_chars: int, *, status: int = 400) -> str:
    """A client string: a non-empty str of printable characters, at most ``max_chars`` long."""
    if not isinstance(value, str):
        raise RequestError(status, f"{field}: must be a string, got {type(value).__name__}", param=field)
    if not value:
        raise RequestError(status, f"{field}: must not be empty", param=field)
    if len(value) > max_chars:
        raise RequestError(status, f"{field}: at most {max_chars} characters, got {len(value)}", param=field)
    if not value.isprintable():
        raise RequestError(status, f"{field}: control characters are not allowed", param=field)
    return value


@dataclass(frozen=True, slots=True)
class Routes:
    models: Mapping[str, str]  # model name -> experiment key
    prefixes: tuple[tuple[str, str], ...]  # (path prefix, experiment key), longest first
    default_experiment: str = ""


def parse_routes(
    entries: Iterable[str],
    default_experiment: str = "",
    setting: str = "ABPLAT_GATEWAY_ROUTES",
    default_setting: str = "ABPLAT_GATEWAY_DEFAULT_EXPERIMENT",
) -> Routes:
    """``MODEL=EXPERIMENT`` and ``/PREFIX=EXPERIMENT`` entries; ValueError naming the setting."""
    models: dict[str, str] = {}
    prefixes: dict[str, str] = {}
    for entry in entries:
        name, sep, key = entry.partition("=")
        name, key = name.strip(), key.strip()
        if not sep or not name or not key:
            raise ValueError(
                f"Unexpected value {setting} item {entry!r}: use MODEL=EXPERIMENT or /PREFIX=EXPERIMENT."
            )
        if not _KEY_RE.match(key):
            raise ValueError(
                f"Unexpected value {setting} item {entry!r}: {key!r} is not an experiment key (a slug)."
            )
        if name.startswith("/"):
            if not _PREFIX_RE.match(name) or name == "/" or "//" in name or "/../" in name + "/":
                raise ValueError(
                    f"Unexpected value {setting} item {entry!r}: a path prefix is /segment[/segment...] "
                    "of letters, digits and . _ ~ -"
                )
            prefix = name.rstrip("/")
            if any(prefix == p or (prefix + "/").startswith(p + "/") for p in ("/v1", "/healthz")):
                raise ValueError(
                    f"Unexpected value {setting} item {entry!r}: the prefix hides the gateway's own paths."
                )
            if prefix in prefixes:
                raise ValueError(f"Unexpected value {setting}: the prefix {prefix!r} is routed twice.")
            prefixes[prefix] = key
        else:
            if len(name) > MAX_MODEL_CHARS or not name.isprintable():
                raise ValueError(f"Unexpected value {setting} item {entry!r}: not a model name.")
            if name in models:
                raise ValueError(f"Unexpected value {setting}: the model {name!r} is routed twice.")
            models[name] = key
    if default_experiment and not _KEY_RE.match(default_experiment):
        raise ValueError(
            f"Unexpected value {default_setting}={default_experiment!r}: not an experiment key (a slug)."
        )
    ordered = tuple(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))
    return Routes(dict(models), ordered, default_experiment)


def split_path(path: str, routes: Routes) -> tuple[str | None, str]:
    """(the experiment a path prefix routes to, or None; the API path after the prefix).
    RequestError 404 when what remains is not an API path the gateway serves."""
    for prefix, key in routes.prefixes:
        if path.startswith(prefix + "/"):
            rest = path[len(prefix) :]
            if rest in API_PATHS:
                return key, rest
            break
    if path in API_PATHS:
        return None, path
    raise RequestError(404, f"no such endpoint: {path[:120]!r}", code="not_found")


def experiment_for(model: object, prefix_experiment: str | None, routes: Routes) -> str:
    """The experiment key of a request (step 1 of the module docstring)."""
    name = check_text(model, "model", MAX_MODEL_CHARS)
    routed = routes.models.get(name)
    if routed is not None:
        return routed
    if prefix_experiment is not None:
        return prefix_experiment
    return name


def key_user(api_key: str) -> str:
    """The user id of a request known only by its API key: stable, and not the key itself."""
    return "key-" + hashlib.sha256(_KEY_USER_SALT + api_key.encode()).hexdigest()[:32]


def user_for(
    body_user: object, header_value: str | None, api_key: str | None
) -> tuple[str | None, UserSource]:
    """Step 2: (user id or None, where it came from). ``body_user`` is the body's ``user``
    (None: absent); ``header_value`` the configured header's value (None: absent or not set)."""
    if body_user is not None:
        return check_text(body_user, "user", MAX_USER_CHARS), UserSource.BODY
    if header_value is not None:
        return check_text(header_value, "user header", MAX_USER_CHARS), UserSource.HEADER
    if api_key:
        return key_user(api_key), UserSource.API_KEY
    return None, UserSource.NONE


@dataclass(frozen=True, slots=True)
class Decision:
    experiment: str  # the experiment whose variant serves (the default one for Reason.DEFAULT)
    variant: str
    revision: int  # the weights document revision used; 0 when the router was not asked
    reason: Reason
    requested: str  # the experiment key the request asked for


def decide(
    experiment: str,
    user_id: str | None,
    *,
    controls: Mapping[str, str],
    assign: Callable[[str, str], tuple[str, int]],
    default_experiment: str = "",
    may_reach: Callable[[str], bool] | None = None,
) -> Decision:
    """Step 3. ``controls``: every experiment the gateway serves -> its control's key.
    ``assign(experiment, user)`` -> (variant, revision), LookupError when the router holds
    no weights for the experiment. ``may_reach(experiment)``: whether this request's tenant
    may reach it (None: every tenant reaches every served experiment); the default experiment
    serves every tenant."""
    control = controls.get(experiment)
    if control is not None and may_reach is not None and experiment != default_experiment:
        if not may_reach(experiment):
            control = None  # as if unknown: the tenant learns nothing about it
    if control is None:
        default_control = controls.get(default_experiment) if default_experiment else None
        if default_control is None:
            raise RequestError(
                404, f"model {experiment[:120]!r}: no such model", param="model", code="model_not_found"
            )
        return Decision(default_experiment, default_control, 0, Reason.DEFAULT, experiment)
    if user_id is None:
        return Decision(experiment, control, 0, Reason.UNASSIGNED, experiment)
    try:
        variant, revision = assign(experiment, user_id)
    except LookupError:
        return Decision(experiment, control, 0, Reason.NOT_RUNNING, experiment)
    return Decision(experiment, variant, revision, Reason.ASSIGNED, experiment)


def parse_retry_on_control(
    entries: Iterable[str], setting: str = "ABPLAT_GATEWAY_RETRY_ON_CONTROL"
) -> frozenset[str]:
    """Experiment keys, or ``*`` for every experiment."""
    out = set()
    for entry in entries:
        if entry != "*" and not _KEY_RE.match(entry):
            raise ValueError(f"Unexpected value {setting} item {entry!r}: an experiment key, or * for all.")
        out.add(entry)
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Reach:
    """Which experiments each tenant may reach (``ABPLAT_GATEWAY_REACH``).

    ``scopes``: tenant -> its scopes: ``*`` (every served experiment), an experiment key, or
    ``team:NAME`` (every experiment of that team). ``configured`` False (the setting is empty):
    every tenant reaches every served experiment. Configured, a tenant that is not listed
    reaches only the default experiment."""

    scopes: Mapping[str, frozenset[str]]
    configured: bool = False

    def allows(self, tenant: str, experiment: str, team: str) -> bool:
        if not self.configured:
            return True
        mine = self.scopes.get(tenant)
        if not mine:
            return False
        return "*" in mine or experiment in mine or f"team:{team}" in mine


_TENANT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # gateway.limits.parse_keys' tenants
_TEAM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_reach(entries: Iterable[str], setting: str = "ABPLAT_GATEWAY_REACH") -> Reach:
    """``TENANT=SCOPE`` entries (a tenant may be listed more than once); ValueError naming the
    setting and the entry."""
    scopes: dict[str, set[str]] = {}
    for entry in entries:
        tenant, sep, scope = entry.partition("=")
        tenant, scope = tenant.strip(), scope.strip()
        if not sep or not _TENANT_RE.match(tenant):
            raise ValueError(
                f"Unexpected value {setting} item {entry!r}: use TENANT=EXPERIMENT, TENANT=team:NAME or "
                "TENANT=* (the tenant as in the keys file: letters, digits, - and _)."
            )
        if scope.startswith("team:"):
            if not _TEAM_RE.match(scope[5:]):
                raise ValueError(
                    f"Unexpected value {setting} item {entry!r}: {scope[5:]!r} is not a team name."
                )
        elif scope != "*" and not _KEY_RE.match(scope):
            raise ValueError(
                f"Unexpected value {setting} item {entry!r}: {scope!r} is not an experiment key, team:NAME or *."
            )
        scopes.setdefault(tenant, set()).add(scope)
    return Reach({t: frozenset(s) for t, s in scopes.items()}, configured=bool(scopes))
