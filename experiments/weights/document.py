"""The weights document: one JSON object per experiment in the weights store (pure).

Example (``schema_version`` 1)::

    {"schema_version": 1, "experiment": "llama-quant", "control": "fp16",
     "weights": {"fp16": 50, "awq": 30, "awq-fa2": 20},
     "salt": "9f2c...", "hash_version": 1,
     "allocation": {"n_buckets": 10000, "variants": ["fp16", "awq", "awq-fa2"],
                    "runs": [[0, 5000], [1, 3000], [2, 2000]]},
     "actor": "alice", "at": "2025-01-31T12:00:00Z", "reason": "ramp awq"}

The allocation (the bucket table, run-length encoded) travels with the weights so every router
computes the same assignment without re-deriving it; ``parse_document`` checks the two agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from experiments.assignment import (
    HASH_VERSION,
    SUPPORTED_HASH_VERSIONS,
    Allocation,
    AllocationError,
    allocate,
    moved_buckets,
    rebalance,
    target_counts,
    total_variation,
    validate_weights,
)
from experiments.weights.errors import ConflictError, WeightsError

__all__ = [
    "SCHEMA_VERSION",
    "ConflictError",
    "MovePreview",
    "WeightsDocument",
    "WeightsError",
    "build_document",
    "parse_document",
    "preview_move",
    "validate_key",
]

SCHEMA_VERSION = 1
# Experiment and variant keys: Django slugs (the model's SlugField), also safe as file names.
KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
FIELDS = (
    "schema_version",
    "experiment",
    "control",
    "weights",
    "salt",
    "hash_version",
    "allocation",
    "actor",
    "at",
    "reason",
)
MAX_SALT = 128
MAX_ACTOR = 150
MAX_REASON = 2000
# Every router expands the bucket table in memory: a stored document may not ask for more.
MAX_BUCKETS = 1_000_000


def validate_key(key: object, path: str = "experiment") -> list[str]:
    if not isinstance(key, str) or not KEY_RE.match(key):
        message = (
            f"{path}: must be a slug of letters, digits, '-' or '_' (1-64 chars, starting with a "
            f"letter or digit), got {key!r}"
        )
        return [message]
    return []


@dataclass(frozen=True, slots=True)
class WeightsDocument:
    experiment: str
    control: str
    weights: Mapping[str, int]
    salt: str
    allocation: Allocation
    actor: str
    at: str
    reason: str
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        # A read-only view: documents are shared by router snapshots across threads.
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    @property
    def hash_version(self) -> int:
        return self.allocation.hash_version

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "experiment": self.experiment,
            "control": self.control,
            "weights": dict(self.weights),
            "salt": self.salt,
            "hash_version": self.hash_version,
            "allocation": self.allocation.to_json(),
            "actor": self.actor,
            "at": self.at,
            "reason": self.reason,
        }

    def dumps(self) -> bytes:
        # Field order fixed by to_json (readable in etcdctl), no whitespace, UTF-8.
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False).encode()


def _text(errors: list[str], data: Mapping[str, Any], name: str, max_len: int) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{name}: must be a non-empty string, got {value!r}")
        return ""
    if len(value) > max_len:
        errors.append(f"{name}: must be at most {max_len} characters, got {len(value)}")
    return value


def _int(errors: list[str], data: Mapping[str, Any], name: str) -> int | None:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(f"{name}: must be an integer, got {value!r}")
        return None
    return value


def _decode(raw: bytes | str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WeightsError(f"document: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WeightsError(
            f"document: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of over 4300 digits; nesting past the stack
        raise WeightsError("document: not valid JSON (a number too long or nesting too deep)") from None
    if not isinstance(data, dict):
        raise WeightsError(f"document: must be a JSON object, got {type(data).__name__}")
    return data


def parse_document(raw: bytes | str | Mapping[str, Any], expected_key: str | None = None) -> WeightsDocument:
    """Strictly validate a stored document; raise WeightsError listing every problem."""
    data = _decode(raw)
    errors: list[str] = []

    missing = [f for f in FIELDS if f not in data]
    if missing:
        errors.append(f"document: missing fields {missing}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        errors.append(f"document: unknown fields {unknown}")

    schema_version = _int(errors, data, "schema_version")
    if schema_version is not None and schema_version != SCHEMA_VERSION:
        errors.append(f"schema_version: this code reads version {SCHEMA_VERSION}, got {schema_version}")

    experiment = data.get("experiment")
    key_errors = validate_key(experiment)
    errors += key_errors
    if not key_errors and expected_key is not None and experiment != expected_key:
        errors.append(
            f"experiment: {experiment!r} does not match the key it is stored under {expected_key!r}"
        )

    weights = data.get("weights")
    weight_errors = validate_weights(weights) if weights is not None else []
    if weights is not None and not weight_errors:
        for variant in weights:
            weight_errors += validate_key(variant, f"weights.{variant}")
    errors += weight_errors

    control = data.get("control")
    if not isinstance(control, str):
        errors.append(f"control: must be a variant key string, got {control!r}")
    elif isinstance(weights, Mapping) and not weight_errors and control not in weights:
        errors.append(f"control: {control!r} is not one of the variants {sorted(weights)}")

    salt = _text(errors, data, "salt", MAX_SALT)
    hash_version = _int(errors, data, "hash_version")
    if hash_version is not None and hash_version not in SUPPORTED_HASH_VERSIONS:
        errors.append(
            f"hash_version: unsupported version {hash_version}, supported: {sorted(SUPPORTED_HASH_VERSIONS)}"
        )
        hash_version = None

    allocation: Allocation | None = None
    n_buckets = data["allocation"].get("n_buckets") if isinstance(data.get("allocation"), Mapping) else None
    if isinstance(n_buckets, int) and n_buckets > MAX_BUCKETS:
        errors.append(f"allocation.n_buckets: must be at most {MAX_BUCKETS}, got {n_buckets}")
    elif "allocation" in data and hash_version is not None:
        try:
            allocation = Allocation.from_json(data["allocation"], hash_version)
        except AllocationError as exc:
            errors += str(exc).split("; ")
    if allocation is not None and isinstance(weights, Mapping) and not weight_errors:
        if set(allocation.variants) != set(weights):
            errors.append(
                f"allocation.variants: {sorted(allocation.variants)} differ from the weights' "
                f"variants {sorted(weights)}"
            )
        else:
            expected = target_counts(weights, allocation.n_buckets)
            for variant, count in allocation.counts().items():
                if count != expected[variant]:
                    errors.append(
                        f"allocation: gives {variant!r} {count} of {allocation.n_buckets} "
                        f"buckets but weights.{variant} = {weights[variant]} needs "
                        f"{expected[variant]}"
                    )

    actor = _text(errors, data, "actor", MAX_ACTOR)
    reason = _text(errors, data, "reason", MAX_REASON)
    at = data.get("at")
    if not isinstance(at, str):
        errors.append(f"at: must be an ISO 8601 timestamp string, got {at!r}")
    else:
        try:
            parsed_at = datetime.fromisoformat(at)
        except ValueError:
            errors.append(f"at: not an ISO 8601 timestamp: {at!r}")
        else:
            if parsed_at.tzinfo is None:
                errors.append(f"at: must carry a timezone (e.g. 'Z'), got {at!r}")

    if errors:
        raise WeightsError(errors)
    assert allocation is not None and isinstance(weights, Mapping)
    return WeightsDocument(
        experiment=str(experiment),
        control=str(control),
        weights=weights,
        salt=salt,
        allocation=allocation,
        actor=actor,
        at=str(at),
        reason=reason,
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_document(
    experiment: str,
    weights: Mapping[str, int],
    *,
    salt: str,
    control: str,
    actor: str,
    reason: str,
    previous: WeightsDocument | None = None,
    at: str | None = None,
    hash_version: int = HASH_VERSION,
) -> WeightsDocument:
    """The next document: the previous table rebalanced (minimal movement), or a fresh one."""
    errors = validate_key(experiment) + validate_weights(weights)
    if previous is not None and previous.salt != salt:
        errors.append(
            f"salt: {salt!r} differs from the stored document's salt {previous.salt!r}; "
            f"changing it would reshuffle every user"
        )
    if previous is not None and previous.experiment != experiment:
        errors.append(
            f"experiment: {experiment!r} does not match the previous document's {previous.experiment!r}"
        )
    if errors:
        raise WeightsError(errors)
    if previous is None:
        allocation = allocate(weights, hash_version=hash_version)
    else:
        allocation = rebalance(previous.allocation, weights)
    raw = {
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment,
        "control": control,
        "weights": dict(weights),
        "salt": salt,
        "hash_version": allocation.hash_version,
        "allocation": allocation.to_json(),
        "actor": actor,
        "at": at or _now(),
        "reason": reason,
    }
    # Round-trip through the strict parser: what we write is exactly what routers accept.
    return parse_document(raw)


@dataclass(frozen=True, slots=True)
class MovePreview:
    """What a weight change does to users, before it is written."""

    moved_buckets: int
    n_buckets: int
    moved_share: float  # expected share of users who change variant
    minimum_share: float  # total variation distance: no scheme can move fewer
    before: Mapping[str, int]
    after: Mapping[str, int]

    def describe(self) -> str:
        return (
            f"{self.moved_share:.2%} of users change variant "
            f"({self.moved_buckets}/{self.n_buckets} buckets; minimum possible "
            f"{self.minimum_share:.2%})"
        )


def preview_move(previous: WeightsDocument | None, new: WeightsDocument) -> MovePreview:
    if previous is None:
        # First weights of an experiment: nobody had a variant yet.
        return MovePreview(0, new.allocation.n_buckets, 0.0, 0.0, {}, dict(new.weights))
    moved = moved_buckets(previous.allocation, new.allocation)
    return MovePreview(
        moved_buckets=moved,
        n_buckets=new.allocation.n_buckets,
        moved_share=moved / new.allocation.n_buckets,
        minimum_share=total_variation(previous.weights, new.weights),
        before=dict(previous.weights),
        after=dict(new.weights),
    )
