"""The experiment document: one shape for the REST API body, files applied from the command
line, and exports. Pure: no Django imports.

``validate_document(raw)`` returns a normalized document or raises ``DocumentError`` with every
problem found, each naming its field path (``variants[2].weight``) and the rule it broke.

Egress (streaming/egress.py): an endpoint never carries credentials (``user:key@host``); a
variant that needs them names a secret, ``auth: {secret: NAME}``, and only the NAME is kept.
Given the variant allowlist (``allow``, and ``resolve`` for names not on it), the endpoint's host
must be on it; the Django glue passes the settings' (experiments/checks.py).

``team`` names the team that owns the experiment. It is optional here: experiments.services
fills it in (the experiment's own team, or its author's) and decides who may use which team.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from stats.sequential.guardrail_spec import Guardrail
from streaming.egress import (
    SECRET_NAME_RE,
    SECRET_NAME_RULE,
    Allowlist,
    EgressError,
    check_url,
    ip_literal,
    split_url,
)

SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
FACTOR_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
APIS = ("chat", "completions")
WEIGHT_TOTAL = 100  # weights are integer percentages
MAX_VARIANTS = 26
MAX_SLO_MS = 3_600_000.0

TOP_FIELDS = {"key", "name", "team", "hypothesis", "sla", "variants", "rollout", "analysis", "fidelity"}
SLA_FIELDS = {"ttft_ms", "tpot_ms", "e2e_ms", "target"}
VARIANT_FIELDS = {
    "key",
    "control",
    "weight",
    "endpoint",
    "model",
    "api",
    "http2",
    "factors",
    "engine_args",
    "auth",
    "cost",
}
AUTH_FIELDS = {"secret"}
# How the report analyses the experiment (analysis.units): users as the independent unit, and
# regression adjustment on pre-request covariates. Both on unless a document turns them off.
ANALYSIS_FIELDS = {"cluster_by_user": True, "adjust": True}
# What a mirror replay keeps of the variants' answers (analysis.answer_fidelity): fingerprints
# always (enough for "identical" and where answers part); the texts themselves only where the
# document allows it, store_answers: true. Off unless a document turns it on: answers are what
# users' prompts made the model say, and the sample store is read by every analyst.
# score_share: the share of a mirror run's requests scored afterwards by teacher forcing (the
# control's greedy answer scored under every variant with prompt_logprobs: a top-k truncated KL,
# score_top_k at most vLLM's default --max-logprobs, 20). shadow_share: the share of live requests a
# non-control variant serves that the gateway re-sends greedily to the control, off the user's
# path, to compare the answers (the rollout guardrail identical_answers reads them).
FIDELITY_FIELDS = {"store_answers": False, "score_share": 0.0, "score_top_k": 20, "shadow_share": 0.0}
FIDELITY_SWITCHES = {"store_answers": False}
MAX_SCORE_TOP_K = 20
COST_FIELDS = {"per_hour", "currency"}
CURRENCY_RE = re.compile(r"^[A-Z]{3}$")  # ISO 4217 codes: USD, EUR, JPY
MAX_COST_PER_HOUR = 1_000_000.0
Resolver = Callable[[str], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class DocumentError(ValueError):
    """A rejected document; ``errors`` lists every field problem found."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))

    def as_dict(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for err in self.errors:
            out.setdefault(err.path, []).append(err.message)
        return out


class _Collector:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range: JSON allows 1 followed by 400 zeros
        return None
    return number if math.isfinite(number) else None


def _text(c: _Collector, raw: dict, field: str, *, required: bool, max_len: int) -> str:
    value = raw.get(field)
    if value is None:
        # YAML reads an empty `hypothesis:` as null: for an optional field that is "not given".
        if required:
            c.add(field, "is required")
        return ""
    if not isinstance(value, str):
        c.add(field, f"must be a string, got {type(value).__name__}")
        return ""
    value = value.strip()
    if required and not value:
        c.add(field, "must not be empty")
    if len(value) > max_len:
        c.add(field, f"must be at most {max_len} characters, got {len(value)}")
    return value


SLUG_RULE = "lowercase letters, digits and '-', starting and ending with a letter or digit (max 64)"


def _slug(c: _Collector, value: Any, path: str, example: str) -> Any:
    """A key: missing and malformed are different mistakes, so they get different messages."""
    if value is None or value == "":
        c.add(path, f"is required: {SLUG_RULE}, {example}")
    elif not isinstance(value, str) or not SLUG_RE.match(value):
        c.add(path, f"must be {SLUG_RULE}, got {value!r}")
    return value


def _team(c: _Collector, value: Any) -> str | None:
    """The name of the team that owns the experiment (optional: experiments.services fills it
    in). Whether the author may use that team is the services' question, not this module's."""
    if isinstance(value, str) and SLUG_RE.match(value):
        return value
    shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    c.add("team", f"must be the name of a team ({SLUG_RULE}), got {shown}")
    return None


def _unknown(c: _Collector, raw: dict, allowed: set[str], prefix: str) -> None:
    for name in sorted(set(raw) - allowed, key=str):  # YAML keys may be numbers or null too
        label = repr(name) if isinstance(name, str) and not name.strip() else str(name)
        where = f"{prefix}.{label}" if prefix else label
        c.add(where, f"unknown field; allowed: {', '.join(sorted(allowed))}")


def _validate_sla(c: _Collector, raw: Any) -> dict:
    if not isinstance(raw, dict):
        c.add("sla", "is required: a mapping with ttft_ms and target (optional tpot_ms, e2e_ms)")
        return {}
    _unknown(c, raw, SLA_FIELDS, "sla")
    sla: dict[str, float | None] = {}
    for field in ("ttft_ms", "tpot_ms", "e2e_ms"):
        value = raw.get(field)
        if value is None:
            if field == "ttft_ms":
                c.add("sla.ttft_ms", "is required")
            sla[field] = None
            continue
        number = _number(value)
        if number is None or not 0 < number <= MAX_SLO_MS:
            c.add(f"sla.{field}", f"must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}]")
        sla[field] = number
    target = _number(raw.get("target"))
    if raw.get("target") is None:
        c.add("sla.target", "is required: the share of requests that must meet the SLO")
    elif target is None or not 0 < target < 1:
        c.add("sla.target", "must be a fraction strictly between 0 and 1 (e.g. 0.992)")
    sla["target"] = target
    return sla


def _validate_scalar_map(
    c: _Collector, raw: Any, path: str, *, names_re: re.Pattern | None, dashes: bool = False
):
    """A mapping of names to scalars. dashes=True (engine_args) also accepts vLLM's own flag
    spelling, `max-model-len` for `max_model_len`, and stores the underscore form."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        c.add(path, "must be a mapping")
        return {}
    out = {}
    given: dict[str, str] = {}
    for name, value in raw.items():
        if dashes and isinstance(name, str):
            name, spelled = name.strip().removeprefix("--").replace("-", "_"), name
            if name in given:
                c.add(f"{path}.{spelled}", f"is given twice (as {given[name]!r} and {spelled!r})")
                continue
            given[name] = spelled
        if not isinstance(name, str) or (names_re and not names_re.match(name)):
            spelling = " (or vLLM's dashed flag spelling)" if dashes else ""
            c.add(f"{path}.{name}", f"name must be lowercase letters, digits and _ (max 63){spelling}")
            continue
        if isinstance(value, dict) or (isinstance(value, list) and path.endswith("factors")):
            c.add(f"{path}.{name}", "must be a scalar (string, number or boolean)")
            continue
        if value is None:
            c.add(f"{path}.{name}", "must not be null")
            continue
        out[name] = value
    return out


def _validate_endpoint(
    c: _Collector, value: Any, path: str, allow: Allowlist | None, resolve: Resolver | None
) -> str:
    if not isinstance(value, str) or not value.strip():
        c.add(path, "is required: the http(s) base URL of an OpenAI-compatible server")
        return ""
    value = value.strip().rstrip("/")
    try:
        parts = urlsplit(value)
    except ValueError:  # "http://[::1": an unclosed IPv6 bracket (not echoed: it may hold a password)
        c.add(path, "must be a valid http(s) URL: its host does not parse")
        return ""
    if "@" in parts.netloc:
        # Checked first, and the URL is never echoed back: it carries a password.
        c.add(path, str(_egress_error(split_url, value)))
        return ""
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        c.add(path, f"must be a valid http(s) URL, got {value!r}")
    elif parts.query or parts.fragment:
        c.add(path, "must not carry a query string or fragment")
    elif allow is not None:
        error = _egress_error(lambda url: check_url(url, allow, resolve), value)
        if error is not None:
            c.add(path, str(error))
    return value


def _egress_error(check: Callable[[str], Any], url: str) -> EgressError | None:
    try:
        check(url)
    except EgressError as exc:
        return exc
    return None


def _validate_auth(c: _Collector, raw: Any, path: str) -> dict | None:
    """``auth: {secret: NAME}``; the NAME is never echoed in an error (it may be a pasted token)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        c.add(path, "must be a mapping: {secret: NAME}, NAME a file in the operator's secrets directory")
        return None
    _unknown(c, raw, AUTH_FIELDS, path)
    name = raw.get("secret")
    if not isinstance(name, str) or not SECRET_NAME_RE.match(name):
        c.add(
            f"{path}.secret",
            f"must be the name of a secret the operator configured ({SECRET_NAME_RULE}), "
            "not a token: tokens never go in the document",
        )
        return None
    return {"secret": name}


def _validate_cost(c: _Collector, raw: Any, path: str) -> dict | None:
    """``cost: {per_hour: 4.20, currency: USD}``: the deployment's price per hour (its GPUs), for
    cost per million requests and tokens at SLA capacity (capacity/)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        c.add(path, "must be a mapping: {per_hour: 4.20, currency: USD}")
        return None
    _unknown(c, raw, COST_FIELDS, path)
    per_hour = raw.get("per_hour")
    ok = not isinstance(per_hour, bool) and isinstance(per_hour, int | float) and math.isfinite(per_hour)
    if not ok or not 0 < per_hour <= MAX_COST_PER_HOUR:
        c.add(
            f"{path}.per_hour", f"must be a number above 0 and at most {MAX_COST_PER_HOUR:g} (price per hour)"
        )
        per_hour = None
    currency = raw.get("currency", "USD")
    if not isinstance(currency, str) or not CURRENCY_RE.match(currency):
        c.add(f"{path}.currency", "must be a three-letter ISO 4217 code in capitals, e.g. USD or EUR")
        currency = None
    if per_hour is None or currency is None:
        return None
    return {"per_hour": float(per_hour), "currency": currency}


def _validate_switches(c: _Collector, raw: Any, block: str, fields: dict[str, bool]) -> dict[str, Any]:
    """A block of true/false switches (``analysis``, ``fidelity``); a field left out keeps its
    default."""
    if raw is None:
        return dict(fields)
    if not isinstance(raw, dict):
        shape = ", ".join(f"{name}: {str(default).lower()}" for name, default in fields.items())
        c.add(block, f"must be a mapping: {{{shape}}}")
        return dict(fields)
    _unknown(c, raw, set(fields), block)
    out: dict[str, Any] = {}
    for field, default in fields.items():
        value = raw.get(field, default)
        if not isinstance(value, bool):
            c.add(f"{block}.{field}", "must be true or false")
        out[field] = value
    return out


def _validate_analysis(c: _Collector, raw: Any) -> dict[str, Any]:
    """``analysis: {cluster_by_user: true, adjust: true}``."""
    return _validate_switches(c, raw, "analysis", ANALYSIS_FIELDS)


def _validate_fidelity(c: _Collector, raw: Any) -> dict[str, Any]:
    """``fidelity: {store_answers: false, score_share: 0, score_top_k: 20, shadow_share: 0}``:
    whether mirror replays keep each answer's text, the share of their requests scored by teacher
    forcing (and its top-k), and the share of live requests shadowed to the control."""
    if raw is None:
        return dict(FIDELITY_FIELDS)
    if not isinstance(raw, dict):
        c.add(
            "fidelity",
            "must be a mapping: {store_answers: false, score_share: 0, score_top_k: 20, shadow_share: 0}",
        )
        return dict(FIDELITY_FIELDS)
    _unknown(c, raw, set(FIDELITY_FIELDS), "fidelity")
    out = _validate_switches(
        c, {k: v for k, v in raw.items() if k in FIDELITY_SWITCHES}, "fidelity", FIDELITY_SWITCHES
    )
    for field in ("score_share", "shadow_share"):
        value = raw.get(field, FIDELITY_FIELDS[field])
        ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
        if not ok or not 0.0 <= value <= 1.0:
            c.add(f"fidelity.{field}", f"must be a share from 0 to 1 (0.05 = 5% of requests), got {value!r}")
            value = FIDELITY_FIELDS[field]
        out[field] = float(value)
    top_k = raw.get("score_top_k", FIDELITY_FIELDS["score_top_k"])
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_SCORE_TOP_K:
        c.add(
            "fidelity.score_top_k",
            f"must be a whole number from 1 to {MAX_SCORE_TOP_K} (vLLM's default --max-logprobs), got {top_k!r}",
        )
        top_k = FIDELITY_FIELDS["score_top_k"]
    out["score_top_k"] = int(top_k)
    return out


def _validate_variant(
    c: _Collector, raw: Any, i: int, allow: Allowlist | None = None, resolve: Resolver | None = None
) -> dict:
    path = f"variants[{i}]"
    if not isinstance(raw, dict):
        c.add(path, "must be a mapping")
        return {}
    _unknown(c, raw, VARIANT_FIELDS, path)
    key = _slug(c, raw.get("key"), f"{path}.key", "e.g. awq-fa2")
    control = raw.get("control", False)
    if not isinstance(control, bool):
        c.add(f"{path}.control", "must be true or false")
    weight = raw.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        c.add(f"{path}.weight", "must be a non-negative whole number (percent of users)")
        weight = None
    model = raw.get("model")
    if not isinstance(model, str) or not model.strip():
        c.add(f"{path}.model", "is required: the model name the server serves")
    api = raw.get("api", "chat")
    if api not in APIS:
        c.add(f"{path}.api", f"must be one of {', '.join(APIS)}, got {api!r}")
    http2 = raw.get("http2", False)
    if not isinstance(http2, bool):
        c.add(f"{path}.http2", "must be true or false")
    return {
        "key": key,
        "control": control,
        "weight": weight,
        "endpoint": _validate_endpoint(c, raw.get("endpoint"), f"{path}.endpoint", allow, resolve),
        "model": model.strip() if isinstance(model, str) else model,
        "api": api,
        "http2": http2,
        "factors": _validate_scalar_map(c, raw.get("factors"), f"{path}.factors", names_re=FACTOR_NAME_RE),
        "engine_args": _validate_scalar_map(
            c, raw.get("engine_args"), f"{path}.engine_args", names_re=FACTOR_NAME_RE, dashes=True
        ),
        "auth": _validate_auth(c, raw.get("auth"), f"{path}.auth"),
        "cost": _validate_cost(c, raw.get("cost"), f"{path}.cost"),
    }


def validate_document(raw: Any, *, allow: Allowlist | None = None, resolve: Resolver | None = None) -> dict:
    """Check every rule and return the normalized document, or raise ``DocumentError``.

    allow: the variant allowlist endpoints must satisfy (None: not checked here). resolve: the
    addresses of a host name, for names not on the list (None: such names are rejected)."""
    c = _Collector()
    if not isinstance(raw, dict):
        raise DocumentError([FieldError("(document)", "must be a mapping of fields")])
    _unknown(c, raw, TOP_FIELDS, "")
    key = _slug(c, raw.get("key"), "key", "e.g. ttft-opt")
    doc = {
        "key": key,
        "name": _text(c, raw, "name", required=True, max_len=200),
        "hypothesis": _text(c, raw, "hypothesis", required=False, max_len=2000),
        "sla": _validate_sla(c, raw.get("sla")),
        "variants": [],
    }
    if raw.get("team") is not None:
        doc["team"] = _team(c, raw["team"])
    variants_raw = raw.get("variants")
    if not isinstance(variants_raw, list) or len(variants_raw) < 2:
        c.add("variants", "is required: a list of at least 2 variants (a control and a treatment)")
        raise DocumentError(c.errors)
    if len(variants_raw) > MAX_VARIANTS:
        c.add("variants", f"must have at most {MAX_VARIANTS} variants")
    variants = [_validate_variant(c, v, i, allow, resolve) for i, v in enumerate(variants_raw)]
    doc["variants"] = variants
    _check_across_variants(c, variants)
    if raw.get("rollout") is not None:
        doc["rollout"] = _validate_rollout(c, raw["rollout"], doc, allow, resolve)
    doc["analysis"] = _validate_analysis(c, raw.get("analysis"))
    doc["fidelity"] = _validate_fidelity(c, raw.get("fidelity"))
    _check_shadow_guardrails(c, raw.get("rollout"), doc)
    if c.errors:
        raise DocumentError(c.errors)
    return doc


# The rollout guardrail on answers: it reads the live requests the gateway shadows to the control
# (fidelity.shadow_share), so a plan that names it without a share would never see a sample.
IDENTICAL_ANSWERS = "identical_answers"


def _check_shadow_guardrails(c: _Collector, rollout: Any, doc: dict) -> None:
    """Paths count in the document's own list (a guardrail refused before this one keeps its place)."""
    if not isinstance(rollout, dict) or not isinstance(rollout.get("guardrails"), list):
        return
    share = (doc.get("fidelity") or {}).get("shadow_share", 0.0)
    for i, spec in enumerate(rollout["guardrails"]):
        if isinstance(spec, dict) and spec.get("metric") == IDENTICAL_ANSWERS and not share > 0:
            c.add(
                f"rollout.guardrails[{i}]",
                f"{IDENTICAL_ANSWERS} reads live requests shadowed to the control: set "
                "fidelity.shadow_share above 0 (e.g. 0.05) so the gateway sends some",
            )


def _check_across_variants(c: _Collector, variants: list[dict]) -> None:
    seen: dict[str, int] = {}
    for i, v in enumerate(variants):
        if isinstance(v.get("key"), str):
            if v["key"] in seen:
                c.add(f"variants[{i}].key", f"duplicates variants[{seen[v['key']]}].key {v['key']!r}")
            seen.setdefault(v["key"], i)
    controls = [i for i, v in enumerate(variants) if v.get("control") is True]
    if len(controls) != 1:
        found = ", ".join(f"variants[{i}]" for i in controls) or "none"
        c.add("variants", f"exactly one variant must have control: true (found {found})")
    weights = [v.get("weight") for v in variants]
    if all(isinstance(w, int) for w in weights) and sum(weights) != WEIGHT_TOTAL:
        c.add("variants", f"weights must sum to {WEIGHT_TOTAL} (percent), got {sum(weights)}")
    names = [set(v.get("factors", {})) for v in variants if v]
    if names and any(n != names[0] for n in names):
        for i, v in enumerate(variants):
            if v and set(v.get("factors", {})) != names[0]:
                c.add(
                    f"variants[{i}].factors",
                    f"must name the same factors as variants[0] ({', '.join(sorted(names[0])) or 'none'}), "
                    f"got {', '.join(sorted(v.get('factors', {}))) or 'none'}",
                )


def weights_of(doc: dict) -> dict[str, int]:
    return {v["key"]: v["weight"] for v in doc["variants"]}


# ---- rollout plan ---------------------------------------------------------------------------

ROLLOUT_FIELDS = {
    "candidate",
    "steps",
    "min_samples",
    "min_duration",
    "guardrails",
    "on_breach",
    "notify",
    "alpha",
}
ON_BREACH = ("rollback", "pause")
SLA_TARGET = "sla_target"  # `at_least: sla_target`: the experiment's own SLA target
# Guardrail latencies a quantile metric may name (p99_ttft_ms): columns of the samples table.
ROLLOUT_LATENCIES = ("ttft_ms", "tpot_ms", "e2e_ms", "itl_mean_ms", "itl_p99_ms")
MAX_STEPS = 20
MAX_NOTIFY = 10
MAX_DURATION_S = 7 * 24 * 3600
DEFAULT_ROLLOUT_ALPHA = 0.05
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any) -> float:
    """Seconds from "30s", "10m", "1h", "1d" or "500ms"; ValueError naming the rule."""
    m = _DURATION_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f'must be a duration like "30s", "10m" or "1h", got {value!r}')
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not 0 <= seconds <= MAX_DURATION_S:
        raise ValueError(f"must be at most 7 days, got {value!r}")
    return seconds


def resolve_guardrail(spec: dict, sla_target: float | None) -> Guardrail:
    """The Guardrail a document's mapping names, ``sla_target`` replaced by the experiment's
    target (ValueError when the experiment has none)."""
    spec = dict(spec)
    for rule, value in spec.items():
        if value == SLA_TARGET:
            if sla_target is None:
                raise ValueError(f"{rule}: sla_target needs the experiment's sla.target")
            spec[rule] = sla_target
    return Guardrail.from_mapping(spec, "guardrail")


def _validate_steps(c: _Collector, raw: Any) -> list[int]:
    if not isinstance(raw, list) or not raw:
        c.add("rollout.steps", "is required: a list of percents of users, increasing, ending at 100")
        return []
    if len(raw) > MAX_STEPS:
        c.add("rollout.steps", f"must have at most {MAX_STEPS} steps, got {len(raw)}")
    steps: list[int] = []
    for i, p in enumerate(raw):
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p <= 100:
            c.add(f"rollout.steps[{i}]", f"must be a whole percent with 0 < p <= 100, got {p!r}")
            return []
        if steps and p <= steps[-1]:
            c.add(f"rollout.steps[{i}]", f"must be larger than the step before ({steps[-1]}), got {p}")
            return []
        steps.append(p)
    if steps[-1] != 100:
        c.add("rollout.steps", f"must end at 100 (all users on the candidate), got {steps[-1]}")
    return steps


# Webhook URLs as shown to whoever may not read them: a webhook's path or query often carries
# the receiver's token (Slack, PagerDuty, ...), so only the scheme, host and port are kept.
REDACTED_PATH = "/[redacted]"
REDACTED = "[redacted]"


def redact_url(url: Any) -> str:
    """``https://hooks.example.com:8443/[redacted]``: the scheme, host and port of ``url``, its
    path, query, fragment and any credentials replaced. A value that does not parse as a URL
    with a host is replaced whole."""
    if not isinstance(url, str):
        return REDACTED
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return REDACTED
    if parts.scheme not in ("http", "https") or not host:
        return REDACTED
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{f':{port}' if port is not None else ''}{REDACTED_PATH}"


def is_redacted_url(url: Any) -> bool:
    return isinstance(url, str) and (url.strip() == REDACTED or url.strip().endswith(REDACTED_PATH))


def scrub_url(text: str, url: str) -> str:
    """``text`` (an error message) with ``url``, and its path and query where they appear on
    their own, replaced by the redacted URL."""
    shown = redact_url(url)
    text = text.replace(url, shown)
    try:
        parts = urlsplit(url)
    except ValueError:
        return text
    tail = parts.path + (f"?{parts.query}" if parts.query else "")
    return text.replace(tail, shown) if len(tail) > 1 else text


def redact_rollout(rollout: Any) -> Any:
    """A copy of a ``rollout:`` block with its webhook URLs redacted (anything else as is)."""
    if not isinstance(rollout, dict) or not isinstance(rollout.get("notify"), list):
        return rollout
    return {**rollout, "notify": [redact_url(u) for u in rollout["notify"]]}


def _validate_notify(c: _Collector, raw: Any, allow: Allowlist | None, resolve: Resolver | None) -> list[str]:
    """Webhook URLs: https to a public name, or a host the variant allowlist allows. Never
    credentials in the URL (not echoed), never a private or link-local IP literal unless allowed."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        c.add("rollout.notify", "must be a list of webhook URLs")
        return []
    if len(raw) > MAX_NOTIFY:
        c.add("rollout.notify", f"must have at most {MAX_NOTIFY} URLs, got {len(raw)}")
    urls: list[str] = []
    for i, url in enumerate(raw):
        path = f"rollout.notify[{i}]"
        if not isinstance(url, str) or not url.strip():
            c.add(path, "must be a webhook URL (https, or a host on the allowlist)")
            continue
        url = url.strip()
        if is_redacted_url(url):
            c.add(
                path,
                f"{url} is a redacted webhook URL (as shown to roles that may not read webhooks): give "
                "the full URL; a redacted one is accepted only in place of the URL it stands for",
            )
            continue
        try:
            parts = urlsplit(url)
            port_ok = parts.port is None or 0 < parts.port < 65536
        except ValueError:
            c.add(path, "must be a valid http(s) URL: its host or port does not parse")
            continue
        if "@" in parts.netloc:
            c.add(path, "must not carry credentials (user:password@host); the URL is not shown")
            continue
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            c.add(path, f"must be a valid http(s) URL, got {url!r}")
            continue
        allowed = None
        if allow is not None:
            allowed = _egress_error(lambda u: check_url(u, allow, resolve), url)
        literal = ip_literal(parts.hostname)
        if parts.scheme == "https" and literal is None:
            urls.append(url)  # a public name over TLS
        elif allow is not None and allowed is None:
            urls.append(url)  # a host the operator allows
        elif parts.scheme == "https":
            c.add(
                path,
                f"IP address {parts.hostname} is not on the variant allowlist: webhooks go to "
                "names over https, or to hosts the allowlist allows",
            )
        else:
            c.add(
                path,
                f"must use https, or name a host on the variant allowlist; {parts.hostname} is not"
                + (f" ({allowed})" if allowed is not None else " (no allowlist given)"),
            )
    return urls


def _validate_rollout(
    c: _Collector, raw: Any, doc: dict, allow: Allowlist | None, resolve: Resolver | None
) -> dict | None:
    """The ``rollout:`` block. Keeps ``sla_target`` symbolic (it follows the SLA when that
    changes); each guardrail is checked with the target resolved."""
    if not isinstance(raw, dict):
        c.add("rollout", "must be a mapping: candidate, steps, min_samples, min_duration, guardrails")
        return None
    _unknown(c, raw, ROLLOUT_FIELDS, "rollout")
    keys = [v.get("key") for v in doc["variants"]]
    control = next((v.get("key") for v in doc["variants"] if v.get("control") is True), None)
    candidate = raw.get("candidate")
    if not isinstance(candidate, str) or not candidate:
        c.add("rollout.candidate", "is required: the key of the variant being rolled out")
    elif candidate not in keys:
        c.add("rollout.candidate", f"must be one of the variants {keys}, got {candidate!r}")
    elif candidate == control:
        c.add("rollout.candidate", f"must not be the control ({control!r}): the control takes the rest")
    elif len(doc["variants"]) != 2:
        c.add("rollout", "a rollout moves users between the control and one candidate: use 2 variants")
    steps = _validate_steps(c, raw.get("steps"))
    min_samples = raw.get("min_samples")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        c.add(
            "rollout.min_samples", f"is required: a whole number >= 1 per step and arm, got {min_samples!r}"
        )
    min_duration = raw.get("min_duration")
    try:
        parse_duration(min_duration)
    except ValueError as exc:
        c.add("rollout.min_duration", str(exc))
    alpha = raw.get("alpha", DEFAULT_ROLLOUT_ALPHA)
    if _number(alpha) is None or not 0 < alpha < 0.5:
        c.add("rollout.alpha", f"must be a number in (0, 0.5), got {alpha!r}")
    guardrails: list[dict] = []
    graw = raw.get("guardrails")
    if not isinstance(graw, list) or not graw:
        c.add("rollout.guardrails", "is required: a list like [{metric: attainment, at_least: sla_target}]")
    else:
        target = doc.get("sla", {}).get("target")
        for i, spec in enumerate(graw):
            path = f"rollout.guardrails[{i}]"
            try:
                if not isinstance(spec, dict):
                    raise ValueError(f"must be a mapping with a metric and one rule, got {spec!r}")
                g = resolve_guardrail(spec, target)
            except ValueError as exc:
                c.add(path, str(exc).removeprefix("guardrail: "))
                continue
            if g.quantile is not None and g.quantile[1] not in ROLLOUT_LATENCIES:
                c.add(
                    f"{path}.metric",
                    f"latency must be one of {', '.join(ROLLOUT_LATENCIES)}, got {g.metric!r}",
                )
                continue
            guardrails.append(dict(spec))
    on_breach = raw.get("on_breach", "rollback")
    if on_breach not in ON_BREACH:
        c.add("rollout.on_breach", f"must be one of {', '.join(ON_BREACH)}, got {on_breach!r}")
    return {
        "candidate": candidate,
        "steps": steps,
        "min_samples": min_samples,
        "min_duration": min_duration.strip() if isinstance(min_duration, str) else min_duration,
        "guardrails": guardrails,
        "on_breach": on_breach,
        "notify": _validate_notify(c, raw.get("notify"), allow, resolve),
        "alpha": float(alpha) if _number(alpha) is not None else alpha,
    }
