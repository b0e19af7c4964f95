"""Deterministic, versioned traffic-split assignment (pure: stdlib only).

A user lands in one of ``n_buckets`` buckets by hashing ``f"{salt}:{user_id}"``; a bucket table
(stored run-length encoded next to the weights) maps each bucket to a variant. Changing weights
re-labels only as many buckets as the weights require, so the share of users who switch variant
equals the total variation distance between the old and new weights, for any number of variants.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# Version 1 of the bucketing algorithm. A change to the hash, the key format or the bucket count
# is a new version with its own golden vectors, never an edit of this one.
HASH_VERSION = 1
DEFAULT_BUCKETS = 10_000
SUPPORTED_HASH_VERSIONS = frozenset({1})

_sha256 = hashlib.sha256
_from_bytes = int.from_bytes


class AllocationError(ValueError):
    """Weights or a bucket table that cannot be used; the message names the field."""


def bucket_v1(salt: str, user_id: str, n_buckets: int = DEFAULT_BUCKETS) -> int:
    # sha256, not Python's hash() (salted per process) nor crc32 (poorly mixed low bits):
    # the first 8 bytes big-endian modulo n; the modulo bias (2**64 % 10_000) is ~5e-16.
    digest = _sha256(f"{salt}:{user_id}".encode()).digest()
    return _from_bytes(digest[:8], "big") % n_buckets


_BUCKET_FUNCTIONS: dict[int, Callable[[str, str, int], int]] = {1: bucket_v1}


def bucket(salt: str, user_id: str, n_buckets: int = DEFAULT_BUCKETS, version: int = 1) -> int:
    try:
        func = _BUCKET_FUNCTIONS[version]
    except KeyError:
        raise AllocationError(
            f"hash_version: unsupported version {version!r}, supported: {sorted(SUPPORTED_HASH_VERSIONS)}"
        ) from None
    return func(salt, user_id, n_buckets)


def validate_weights(weights: Mapping[str, object], path: str = "weights") -> list[str]:
    """Every problem with a weights mapping, each naming its field; empty when valid."""
    errors: list[str] = []
    if not isinstance(weights, Mapping):
        return [f"{path}: must be an object mapping variant key to integer percent"]
    if not weights:
        return [f"{path}: must name at least one variant"]
    total = 0
    for key, weight in weights.items():
        if not isinstance(key, str) or not key.strip():
            errors.append(f"{path}: variant keys must be non-empty strings, got {key!r}")
            continue
        # bool is an int subclass; True must not pass as a weight of 1.
        if isinstance(weight, bool) or not isinstance(weight, int):
            errors.append(f"{path}.{key}: must be an integer percent, got {weight!r}")
            continue
        if weight < 0:
            errors.append(f"{path}.{key}: must be >= 0, got {weight}")
            continue
        total += weight
    if not errors and total != 100:
        errors.append(f"{path}: weights must sum to 100, got {total}")
    return errors


def _checked_weights(weights: Mapping[str, int]) -> dict[str, int]:
    errors = validate_weights(weights)
    if errors:
        raise AllocationError("; ".join(errors))
    return dict(weights)


def target_counts(weights: Mapping[str, int], n_buckets: int = DEFAULT_BUCKETS) -> dict[str, int]:
    # n_buckets is a multiple of 100, so an integer percent is an exact number of buckets.
    return {key: weight * n_buckets // 100 for key, weight in weights.items()}


@dataclass(frozen=True, slots=True)
class Allocation:
    """An immutable bucket table. ``runs`` is the RLE form: (variant index, run length)."""

    variants: tuple[str, ...]
    runs: tuple[tuple[int, int], ...]
    n_buckets: int = DEFAULT_BUCKETS
    hash_version: int = HASH_VERSION
    # bucket -> variant key, expanded once so assign() is a single tuple index.
    lookup: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        errors = _allocation_errors(self.variants, self.runs, self.n_buckets, self.hash_version)
        if errors:
            raise AllocationError("; ".join(errors))
        table: list[str] = []
        for index, length in self.runs:
            table.extend([self.variants[index]] * length)
        object.__setattr__(self, "lookup", tuple(table))

    @classmethod
    def from_table(
        cls,
        table: Sequence[str],
        variants: Sequence[str],
        hash_version: int = HASH_VERSION,
    ) -> Allocation:
        index_of = {key: i for i, key in enumerate(variants)}
        runs: list[list[int]] = []
        for key in table:
            index = index_of[key]
            if runs and runs[-1][0] == index:
                runs[-1][1] += 1
            else:
                runs.append([index, 1])
        return cls(
            variants=tuple(variants),
            runs=tuple((i, n) for i, n in runs),
            n_buckets=len(table),
            hash_version=hash_version,
        )

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.variants, 0)
        for index, length in self.runs:
            counts[self.variants[index]] += length
        return counts

    def weights(self) -> dict[str, int]:
        return {key: n * 100 // self.n_buckets for key, n in self.counts().items()}

    def to_json(self) -> dict[str, object]:
        return {
            "n_buckets": self.n_buckets,
            "variants": list(self.variants),
            "runs": [[i, n] for i, n in self.runs],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object], hash_version: int = HASH_VERSION) -> Allocation:
        errors: list[str] = []
        if not isinstance(data, Mapping):
            raise AllocationError("allocation: must be an object")
        extra = set(data) - {"n_buckets", "variants", "runs"}
        if extra:
            errors.append(f"allocation: unknown fields {sorted(extra)}")
        n_buckets = data.get("n_buckets")
        variants = data.get("variants")
        runs = data.get("runs")
        if isinstance(n_buckets, bool) or not isinstance(n_buckets, int):
            errors.append(f"allocation.n_buckets: must be an integer, got {n_buckets!r}")
        if not isinstance(variants, list) or not all(isinstance(v, str) for v in variants):
            errors.append("allocation.variants: must be a list of variant key strings")
        if not isinstance(runs, list):
            errors.append("allocation.runs: must be a list of [variant_index, length] pairs")
        else:
            for i, run in enumerate(runs):
                if (
                    not isinstance(run, list)
                    or len(run) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in run)
                ):
                    errors.append(
                        f"allocation.runs[{i}]: must be [variant_index, length] integers, got {run!r}"
                    )
        if errors:
            raise AllocationError("; ".join(errors))
        assert isinstance(variants, list) and isinstance(runs, list)
        assert isinstance(n_buckets, int)
        return cls(
            variants=tuple(variants),
            runs=tuple((r[0], r[1]) for r in runs),
            n_buckets=n_buckets,
            hash_version=hash_version,
        )


def _allocation_errors(
    variants: tuple[str, ...],
    runs: tuple[tuple[int, int], ...],
    n_buckets: int,
    hash_version: int,
) -> list[str]:
    errors: list[str] = []
    if hash_version not in SUPPORTED_HASH_VERSIONS:
        errors.append(
            f"hash_version: unsupported version {hash_version!r}, "
            f"supported: {sorted(SUPPORTED_HASH_VERSIONS)}"
        )
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, int) or n_buckets <= 0:
        errors.append(f"allocation.n_buckets: must be a positive integer, got {n_buckets!r}")
        return errors
    if n_buckets % 100:
        errors.append(
            f"allocation.n_buckets: must be a multiple of 100 so integer percents are exact, got {n_buckets}"
        )
    if not variants:
        errors.append("allocation.variants: must name at least one variant")
    for i, key in enumerate(variants):
        if not isinstance(key, str) or not key.strip():
            errors.append(f"allocation.variants[{i}]: must be a non-empty string, got {key!r}")
    duplicates = sorted(k for k, c in Counter(variants).items() if c > 1)
    if duplicates:
        errors.append(f"allocation.variants: duplicate keys {duplicates}")
    total = 0
    for i, (index, length) in enumerate(runs):
        if not 0 <= index < len(variants):
            errors.append(f"allocation.runs[{i}]: variant index {index} out of range 0..{len(variants) - 1}")
        if length <= 0:
            errors.append(f"allocation.runs[{i}]: length must be > 0, got {length}")
        total += length
    if total != n_buckets:
        errors.append(f"allocation.runs: lengths sum to {total}, expected n_buckets={n_buckets}")
    return errors


def allocate(
    weights: Mapping[str, int],
    n_buckets: int = DEFAULT_BUCKETS,
    hash_version: int = HASH_VERSION,
) -> Allocation:
    """A fresh table: contiguous bucket runs in the order the weights are given."""
    weights = _checked_weights(weights)
    variants = tuple(weights)
    targets = target_counts(weights, n_buckets)
    runs = tuple((i, targets[key]) for i, key in enumerate(variants) if targets[key] > 0)
    return Allocation(variants, runs, n_buckets, hash_version)


def rebalance(old: Allocation, new_weights: Mapping[str, int]) -> Allocation:
    """A table for ``new_weights`` that re-labels only the buckets that must change.

    1. Every variant holding more buckets than its new target (a removed variant's target is 0)
       releases its highest-numbered buckets until it is at target.
    2. The released buckets, in ascending order, go to the variants below target, in variant
       order (kept variants in their old order, then new ones in the order given).
    Buckets released = sum of positive (old - new) = total variation distance x n_buckets, the
    minimum any scheme can move; a variant added at weight 0 releases and receives nothing.
    """
    new_weights = _checked_weights(new_weights)
    n = old.n_buckets
    targets = target_counts(new_weights, n)
    order = [key for key in old.variants if key in new_weights]
    order += [key for key in new_weights if key not in old.variants]

    # 1. release surplus, scanning from the top so the oldest holdings stay put
    table: list[str | None] = list(old.lookup)
    surplus = {
        key: count - targets.get(key, 0) for key, count in old.counts().items() if count > targets.get(key, 0)
    }
    for b in range(n - 1, -1, -1):
        key = table[b]
        if key is not None and surplus.get(key, 0) > 0:
            table[b] = None
            surplus[key] -= 1

    # 2. hand released buckets to the variants in deficit
    current = Counter(k for k in table if k is not None)
    deficits = [(key, targets[key] - current[key]) for key in order if targets[key] > current[key]]
    free = (b for b in range(n) if table[b] is None)
    for key, need in deficits:
        for _ in range(need):
            table[next(free)] = key
    assert all(k is not None for k in table)
    return Allocation.from_table([k for k in table if k is not None], order, hash_version=old.hash_version)


def assign(salt: str, user_id: str, allocation: Allocation) -> str:
    """The variant key for a user. ``user_id`` is formatted with str(): 42 and "42" agree."""
    if allocation.hash_version == 1:  # the fast path skips the version dispatch
        return allocation.lookup[bucket_v1(salt, user_id, allocation.n_buckets)]
    return allocation.lookup[bucket(salt, user_id, allocation.n_buckets, allocation.hash_version)]


def make_assigner(salt: str, allocation: Allocation) -> Callable[[str], str]:
    """assign() with the salt and table bound: one closure per (experiment, weights), kept by
    the router, so the hot path hashes and indexes without re-encoding the salt."""
    if allocation.hash_version != 1:
        return lambda user_id: assign(salt, user_id, allocation)
    # f"{salt}:{user_id}".encode() == f"{salt}:".encode() + f"{user_id}".encode() in UTF-8.
    prefix = f"{salt}:".encode()
    lookup = allocation.lookup
    n = allocation.n_buckets

    def assign_user(user_id: str) -> str:
        digest = _sha256(prefix + f"{user_id}".encode()).digest()
        return lookup[_from_bytes(digest[:8], "big") % n]

    return assign_user


def moved_buckets(old: Allocation, new: Allocation) -> int:
    if old.n_buckets != new.n_buckets or old.hash_version != new.hash_version:
        return new.n_buckets  # a different bucket space reshuffles everyone
    return sum(1 for a, b in zip(old.lookup, new.lookup, strict=True) if a != b)


def moved_share(old: Allocation, new: Allocation) -> float:
    """Expected share of users whose variant changes between two tables."""
    return moved_buckets(old, new) / new.n_buckets


def total_variation(old: Mapping[str, int], new: Mapping[str, int]) -> float:
    """Total variation distance between two percent weightings, as a share in [0, 1]."""
    keys = set(old) | set(new)
    return sum(abs(old.get(k, 0) - new.get(k, 0)) for k in keys) / 200
