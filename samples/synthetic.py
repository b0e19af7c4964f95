"""Seeded synthetic sample rows with a known ground truth, for tests and benchmarks.

Pure numpy (no Django, no database driver): ``generate()`` returns every column of the samples
table as numpy arrays plus the truth that went into them; ``insert()`` writes them through the
store in columnar chunks (10M rows without building one Python dict per row).

The model, per request:
  TTFT = base(prompt tokens, in-flight load) * product of the variant's factor effects * noise
with a lognormal noise shared by all variants of one request in mirror mode (so paired tests
see correlated arms). Errors replace the measurement with a failed outcome. TTFT is split into
the phases the client measures (connect, headers, first event, first content), so the phase
breakdown of misses has known shares.

Every successful request has output_tokens - 1 inter-token gaps (itl_gaps_us, microseconds):
lognormal around the request's TPOT with occasional spikes (a batch stalled by another request's
prefill), scaled so that their mean is the TPOT, as it is in a real stream; itl_mean/p50/p99/max
are those gaps' own statistics. They come from a random stream of their own, so every other
column is what the same seed gave before gaps existed (``gaps=False``: no gaps, as rows recorded
before the samples kept gaps).

Answers (``answers=True``, mirror mode): every request gets one reference answer, a list of
random 32-bit token fingerprints as long as the request's output (the same length for every
variant: they answer the same request), and each variant's successful answer is that one except
with probability ``VariantSpec.divergence_rate``, where it parts at a position drawn uniformly
over the answer and continues with other tokens. ``output_fp`` and ``token_fps`` are filled as
the replay fills them (fidelity.fingerprints), and ``Synthetic.diverged_at`` keeps the truth: the
0-based position per row, -1 where the answer is the reference's or failed. From a stream of
its own, as the gaps. ``answer_texts=True`` also stores each answered row's text, as a mirror
replay of an experiment that allows it does (``answer_text``): each token written as its
fingerprint's 8 hex digits and a middle dot (two bytes of UTF-8), so two texts part at the
first differing hex digit of the first differing token (``answer_text_of``), and ``output_fp``
is the text's fingerprint, as the replay takes it (fidelity.fingerprints).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fidelity import fingerprints
from samples import columns as colmod

DEFAULT_START_MS = 1_732_900_000_000.0  # 2024-11-29, well inside one monthly partition
# Phase split of the TTFT measured by the client (fractions, sum 1, connect only when new).
PHASE_SHARES = {"headers": 0.15, "headers_to_first_event": 0.7, "first_event_to_first_content": 0.15}


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    key: str
    weight: float  # traffic share in split mode (normalized)
    factors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ttft_scale: float = 1.0  # multiplies TTFT on top of factor effects (a non-factor effect)
    error_rate: float = 0.01
    control: bool = False
    divergence_rate: float = 0.0  # share of answers that part from the reference (answers=True)


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    experiment: str = "ttft-opt"
    run_id: int = 1
    n: int = 20_000  # requests (split: rows; mirror: rows per variant)
    mode: str = "split"
    seed: int = 0
    variants: Sequence[VariantSpec] = ()
    # multiplicative TTFT effect of a factor level, e.g. {"quantization=awq": 0.8}
    factor_effects: Mapping[str, float] = dataclasses.field(default_factory=dict)
    base_ttft_ms: float = 90.0
    sigma: float = 0.35  # lognormal noise of TTFT
    ms_per_1k_prompt_tokens: float = 40.0  # prefill cost
    ms_per_in_flight: float = 4.0  # queueing cost per request in flight
    duration_s: float = 3600.0
    start_unix_ms: float = DEFAULT_START_MS
    config_revisions: Sequence[int] = (100,)  # evenly split over the run, in time order
    duplicate_rate: float = 0.0  # extra, OLDER recordings of some requests (must be ignored)
    round_ms: int = 3  # decimals kept on latencies (keeps distinct values realistic)
    gaps: bool = True  # inter-token gaps per successful request (False: none, as older rows)
    gap_sigma: float = 0.3  # lognormal spread of the gaps around the request's TPOT
    gap_spike_rate: float = 0.02  # share of gaps stretched 2-6x (prefill of another request)
    # Users (0: one user per request, as before). With users, each request comes from one of
    # them, heavy-tailed (lognormal rates, sigma 1: a few users send many requests); in split
    # mode the arm is drawn per user (the router keeps a user on one variant), and each user's
    # TTFT is multiplied by their own lognormal factor (user_sigma: their region, client and
    # prompts), so a user's requests are correlated. no_user_share of the requests carry no
    # user id (''), as live requests served before a user is known.
    users: int = 0
    user_sigma: float = 0.0
    no_user_share: float = 0.0
    # The users' own draws (rates, effects, arms) from a stream of this seed instead of the run's:
    # the chunks of one run (generate_chunks) then share their users. None: the run's stream.
    users_seed: int | None = None
    seq_offset: int = 0  # the first request's seq (a chunk of a larger run: generate_chunks)
    max_tokens: Sequence[int] = (256,)  # requested output tokens, drawn per request when several
    answers: bool = False  # mirror mode: fingerprinted answers, some diverging (module docstring)
    answer_texts: bool = False  # with answers: each answer's text too (module docstring)


def demo_variants() -> list[VariantSpec]:
    """The demo experiment's three arms: fp16 control, AWQ, AWQ + FlashAttention-2."""
    return [
        VariantSpec("fp16", 34, {"quantization": "none", "attention": "sdpa"}, control=True),
        VariantSpec("awq", 33, {"quantization": "awq", "attention": "sdpa"}),
        VariantSpec("awq-fa2", 33, {"quantization": "awq", "attention": "flash_attn_2"}),
    ]


DEMO_FACTOR_EFFECTS = {"quantization=awq": 0.8, "attention=flash_attn_2": 0.85}


@dataclasses.dataclass
class Synthetic:
    spec: SyntheticSpec
    columns: dict[str, np.ndarray]  # every samples column, duplicates included
    is_duplicate: np.ndarray  # bool per row: an older recording that reads must not see
    # per row, the 0-based position where the answer parts from the request's reference answer;
    # -1 where it does not (or failed, or answers were not generated)
    diverged_at: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return int(self.is_duplicate.size)

    def latest(self) -> dict[str, np.ndarray]:
        """The rows a deduplicated read must return (independent of ClickHouse)."""
        keep = ~self.is_duplicate
        return {k: v[keep] for k, v in self.columns.items()}

    def chunks(self, size: int) -> list[dict[str, np.ndarray]]:
        return [{k: v[i : i + size] for k, v in self.columns.items()} for i in range(0, self.n_rows, size)]


def _factor_multiplier(spec: SyntheticSpec, v: VariantSpec) -> float:
    m = v.ttft_scale
    for factor, level in v.factors.items():
        m *= spec.factor_effects.get(f"{factor}={level}", 1.0)
    return m


def _check(spec: SyntheticSpec) -> None:
    if spec.mode not in colmod.MODES:
        raise ValueError(f"SyntheticSpec.mode must be one of {colmod.MODES}, got {spec.mode!r}")
    if not spec.variants:
        raise ValueError("SyntheticSpec.variants is empty")
    if sum(1 for v in spec.variants if v.control) != 1:
        raise ValueError("SyntheticSpec.variants needs exactly one control")
    if spec.n < 1:
        raise ValueError(f"SyntheticSpec.n must be >= 1, got {spec.n}")
    if spec.seq_offset < 0 or spec.seq_offset + spec.n > 2**32:
        raise ValueError(
            f"SyntheticSpec.seq_offset + n must fit seq's UInt32, got {spec.seq_offset} + {spec.n}"
        )
    if spec.users < 0 or spec.user_sigma < 0 or not 0 <= spec.no_user_share <= 1 or not spec.max_tokens:
        raise ValueError(
            "SyntheticSpec: users >= 0, user_sigma >= 0, no_user_share in [0, 1], max_tokens given"
        )
    if not 0 <= spec.duplicate_rate <= 1:
        raise ValueError(f"SyntheticSpec.duplicate_rate must be in [0, 1], got {spec.duplicate_rate}")
    for v in spec.variants:
        if not 0 <= v.error_rate < 1 or v.weight < 0 or not 0 <= v.divergence_rate <= 1:
            raise ValueError(
                f"variant {v.key!r}: error_rate in [0, 1), weight >= 0 and divergence_rate in [0, 1] needed"
            )
    if spec.answers and spec.mode != "mirror":
        raise ValueError("SyntheticSpec.answers needs mode 'mirror' (answers are compared per request)")
    if spec.answer_texts and not spec.answers:
        raise ValueError("SyntheticSpec.answer_texts needs answers=True (a text is its answer's tokens)")


def generate(spec: SyntheticSpec) -> Synthetic:
    _check(spec)
    rng = np.random.default_rng(spec.seed)
    keys = [v.key for v in spec.variants]
    n_req = spec.n

    # 1. the traffic: one request per seq, sent in order over the run
    seq_req = np.arange(spec.seq_offset, spec.seq_offset + n_req, dtype=np.uint32)
    offset_ms = np.sort(rng.uniform(0, spec.duration_s * 1000.0, n_req))
    prompt = np.clip(rng.lognormal(np.log(400), 1.0, n_req), 4, 16000).astype(np.uint32)
    in_flight = rng.poisson(6, n_req).astype(np.uint32)
    noise = rng.lognormal(0.0, spec.sigma, n_req)

    # 2. which variant(s) answer each request
    if spec.mode == "split":
        w = np.array([v.weight for v in spec.variants], dtype=float)
        arm = rng.choice(len(keys), size=n_req, p=w / w.sum())
        req = np.arange(n_req)
    else:  # mirror: every request goes to every variant
        arm = np.repeat(np.arange(len(keys)), n_req)
        req = np.tile(np.arange(n_req), len(keys))
    n = arm.size
    # users, user effects and requested tokens come from a stream of their own: without them every
    # other column is what the same seed gave before they existed
    urng = np.random.default_rng([spec.seed, 15])
    user_of = np.arange(n_req)
    user_mult: float | np.ndarray = 1.0
    if spec.users:
        # the same draws in the same order from one stream unless users_seed gives the users their own
        users_rng = urng if spec.users_seed is None else np.random.default_rng([spec.users_seed, 16])
        rates = users_rng.lognormal(0.0, 1.0, spec.users)
        user_of = urng.choice(spec.users, size=n_req, p=rates / rates.sum())
        user_mult = users_rng.lognormal(0.0, spec.user_sigma, spec.users)[user_of][req]
        if spec.mode == "split":
            w = np.array([v.weight for v in spec.variants], dtype=float)
            arm = users_rng.choice(len(keys), size=spec.users, p=w / w.sum())[user_of]
    no_user = urng.random(n_req) < spec.no_user_share if spec.no_user_share else np.zeros(n_req, dtype=bool)
    if len(spec.max_tokens) == 1:
        max_tokens = np.full(n, spec.max_tokens[0], dtype=np.uint32)
    else:
        max_tokens = urng.choice(np.asarray(spec.max_tokens, dtype=np.uint32), size=n_req)[req]

    mult = np.array([_factor_multiplier(spec, v) for v in spec.variants])[arm]
    err_p = np.array([v.error_rate for v in spec.variants])[arm]
    base = (
        spec.base_ttft_ms
        + spec.ms_per_1k_prompt_tokens * prompt[req] / 1000.0
        + spec.ms_per_in_flight * in_flight[req]
    )
    # mirror arms share the request's noise plus a little of their own
    own = rng.lognormal(0.0, spec.sigma / 3, n) if spec.mode == "mirror" else 1.0
    ttft = np.round(base * mult * noise[req] * own * user_mult, spec.round_ms)
    error = rng.random(n) < err_p

    # 3. phases of TTFT as the client sees them
    new_conn = rng.random(n) < 0.1
    connect = np.where(new_conn, np.round(rng.uniform(0.5, 3.0, n), spec.round_ms), np.nan)
    rest = ttft - np.nan_to_num(connect)
    ttfb = np.round(np.nan_to_num(connect) + rest * PHASE_SHARES["headers"], spec.round_ms)
    ttft_event = np.round(ttfb + rest * PHASE_SHARES["headers_to_first_event"], spec.round_ms)
    ttft_event = np.minimum(ttft_event, ttft)
    out_tokens = rng.integers(16, 256, n).astype(np.uint32)
    if spec.answers:  # one answer length per request: every variant answers the same request
        out_tokens = out_tokens[req]
    tpot = np.round(rng.lognormal(np.log(12.0), 0.2, n) * mult, spec.round_ms)
    itl_mean = np.round(tpot * rng.uniform(0.95, 1.05, n), spec.round_ms)  # drawn either way
    itl_p50, itl_p99, itl_max = (
        itl_mean,
        np.round(itl_mean * 2.5, spec.round_ms),
        np.round(itl_mean * 4.0, spec.round_ms),
    )
    if spec.gaps:
        gaps, (itl_mean, itl_p50, itl_p99, itl_max) = _gaps(spec, tpot, np.where(error, 0, out_tokens))
    else:
        gaps = _per_row([np.zeros(0, dtype=np.uint32)] * n)
    e2e = np.round(ttft + tpot * (out_tokens - 1), spec.round_ms)
    lag = np.round(rng.exponential(0.5, n), spec.round_ms)

    def failed(a: np.ndarray) -> np.ndarray:
        return np.where(error, np.nan, a)

    sent_ms = spec.start_unix_ms + offset_ms[req] + lag
    revs = np.asarray(spec.config_revisions, dtype=np.int64)
    rev = revs[
        np.minimum((offset_ms[req] / (spec.duration_s * 1000.0) * len(revs)).astype(int), len(revs) - 1)
    ]
    variant = np.array(keys, dtype=object)[arm]
    seq = seq_req[req]
    user_l, no_user_l = user_of.tolist(), no_user.tolist()  # plain lists: a Python loop reads them
    request_id = np.array(
        [f"r{spec.run_id}-{s:08d}-{v}" for s, v in zip(seq.tolist(), variant.tolist())],
        dtype=object,
    )
    cols: dict[str, np.ndarray] = {
        "experiment": np.full(n, spec.experiment, dtype=object),
        "variant": variant,
        "run_id": np.full(n, spec.run_id, dtype=np.uint64),
        "seq": seq,
        "request_id": request_id,
        "mode": np.full(n, spec.mode, dtype=object),
        # Without spec.users, one user per request: arms are drawn per request then, so users
        # must not repeat across arms (the router keeps a user on one variant; SRM counts
        # distinct users).
        "user_id": np.array(["" if no_user_l[r] else f"u{user_l[r]}" for r in req.tolist()], dtype=object),
        "config_revision": rev,
        "sent_at": (sent_ms // 1000).astype(np.uint32),
        "sent_unix_ms": sent_ms,
        "scheduled_offset_ms": offset_ms[req],
        "schedule_lag_ms": lag,
        "gateway_ms": np.zeros(n),  # a replay's samples (samples.rows)
        "in_flight": in_flight[req],
        "prompt_tokens": prompt[req],
        "prompt_tokens_estimated": np.zeros(n, dtype=np.uint8),
        "max_tokens": max_tokens,
        "worker": np.full(n, "synthetic:0", dtype=object),
        "attempt": np.ones(n, dtype=np.uint8),
        "outcome": np.where(error, "http_5xx", "ok").astype(object),
        "http_status": np.where(error, 503, 200).astype(np.uint16),
        "error": np.where(error, "503 Service Unavailable", "").astype(object),
        "new_connection": new_conn.astype(np.uint8),
        "connect_ms": connect,
        "ttfb_ms": ttfb,  # headers arrive even on a 503
        "first_byte_ms": failed(ttfb),
        "ttft_event_ms": failed(ttft_event),
        "ttft_ms": failed(ttft),
        "itl_mean_ms": failed(itl_mean),
        "itl_p50_ms": failed(itl_p50),
        "itl_p99_ms": failed(itl_p99),
        "itl_max_ms": failed(itl_max),
        "itl_gaps_us": gaps,
        "tpot_ms": failed(tpot),
        "e2e_ms": failed(e2e),
        "output_tokens": np.where(error, 0, out_tokens).astype(np.uint32),
        "usage_reported": np.ones(n, dtype=np.uint8),
        "chunks": np.where(error, 0, out_tokens + 2).astype(np.uint32),
        "finish_reason": np.where(error, "", "length").astype(object),
        "traceparent": np.full(n, "", dtype=object),
        "trace_id": np.full(n, "", dtype=object),
        "server_ttft_ms": np.full(n, np.nan),
        "start_ns": np.zeros(n, dtype=np.uint64),
        "server_first_content_ns": np.full(n, np.nan),
        "output_fp": np.zeros(n, dtype=np.uint64),  # filled below with answers=True
        "token_fps": _per_row([np.zeros(0, dtype=np.uint32)] * n),
        "answer_text": np.full(n, "", dtype=object),  # filled below with answer_texts=True
        "recorded_ms": (sent_ms + 10_000).astype(np.uint64),
    }
    diverged_at = np.full(n, -1, dtype=np.int64)
    if spec.answers:
        cols["output_fp"], cols["token_fps"], diverged_at = _answers(spec, arm, req, out_tokens, error)
    if spec.answer_texts:  # the texts, and output_fp as the replay takes it: of the text
        texts = [answer_text_of(t) if fp else "" for t, fp in zip(cols["token_fps"], cols["output_fp"])]
        cols["answer_text"] = np.array(texts, dtype=object)
        cols["output_fp"] = np.array(
            [fingerprints.output_fp([t]) if t else 0 for t in texts], dtype=np.uint64
        )
    is_dup = np.zeros(n, dtype=bool)

    # 4. older recordings of some requests with wrong values: a correct read never sees them
    n_dup = int(round(spec.duplicate_rate * n))
    if n_dup:
        pick = rng.choice(n, size=n_dup, replace=False)
        dup = {k: v[pick].copy() for k, v in cols.items()}
        dup["recorded_ms"] = dup["recorded_ms"] - 5_000
        dup["ttft_ms"] = dup["ttft_ms"] * 0 + 99_999.0  # would wreck p99.9 if read
        dup["outcome"] = np.full(n_dup, "ok", dtype=object)
        cols = {k: np.concatenate([cols[k], dup[k]]) for k in cols}
        is_dup = np.concatenate([is_dup, np.ones(n_dup, dtype=bool)])
        diverged_at = np.concatenate([diverged_at, diverged_at[pick]])
    missing = set(colmod.COLUMN_NAMES) ^ set(cols)
    assert not missing, f"synthetic columns out of sync with samples.columns: {missing}"
    return Synthetic(spec, {k: cols[k] for k in colmod.COLUMN_NAMES}, is_dup, diverged_at)


def generate_chunks(spec: SyntheticSpec, chunk_rows: int, first_chunk: int = 0) -> Iterator[Synthetic]:
    """One run of spec.n requests generated chunk_rows requests at a time, so a run of 10^8 rows
    never sits in memory at once: chunk k holds seqs [k chunk_rows, (k+1) chunk_rows), sent in the
    k-th slice of the run's duration, under the config revision of that slice (spec's revisions
    split evenly over the chunks, in time order), each chunk from a seed of its own.

    With spec.users, every chunk draws its requests from the same users (users_seed, default
    spec.seed): a user keeps their rate, TTFT effect and arm across chunks, as in one generate().
    The chunks are not generate(spec) cut into pieces (other random streams); their union is one
    run of the same model, with unique request ids and seqs. ``first_chunk``: start at that
    chunk (a load resumed), the later chunks as they would have been."""
    if chunk_rows < 1 or first_chunk < 0:
        raise ValueError(
            f"generate_chunks: chunk_rows >= 1 and first_chunk >= 0 needed, got {chunk_rows}, {first_chunk}"
        )
    _check(spec)
    starts = range(0, spec.n, chunk_rows)
    revs = list(spec.config_revisions)
    users_seed = spec.seed if spec.users_seed is None else spec.users_seed
    for k, first in enumerate(starts):
        if k < first_chunk:
            continue
        size = min(chunk_rows, spec.n - first)
        share = spec.duration_s / spec.n  # each request's slice of the run, so chunks tile it
        part = dataclasses.replace(
            spec,
            n=size,
            seed=spec.seed * 1_000_003 + k,
            seq_offset=spec.seq_offset + first,
            start_unix_ms=spec.start_unix_ms + first * share * 1000.0,
            duration_s=size * share,
            config_revisions=(revs[min(len(revs) - 1, (2 * k + 1) * len(revs) // (2 * len(starts)))],),
            users_seed=users_seed,
        )
        data = generate(part)
        data.columns["scheduled_offset_ms"] = data.columns["scheduled_offset_ms"] + first * share * 1000.0
        yield data


def _answers(
    spec: SyntheticSpec, arm: np.ndarray, req: np.ndarray, out_tokens: np.ndarray, error: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(output_fp, token_fps, diverged_at) per row (module docstring, Answers)."""
    arng = np.random.default_rng([spec.seed, 37])
    n = arm.size
    # mirror rows are the first arm's requests 0..n-1, then the next arm's, ...: row r is request r
    reference = [arng.integers(1, 2**32, int(k), dtype=np.uint32) for k in out_tokens[: spec.n]]
    rate = np.array([v.divergence_rate for v in spec.variants])[arm]
    parts = arng.random(n) < rate
    where = np.floor(arng.random(n) * out_tokens).astype(np.int64)
    output_fp = np.zeros(n, dtype=np.uint64)
    fps: list[np.ndarray] = []
    diverged_at = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        if error[i]:
            fps.append(np.zeros(0, dtype=np.uint32))
            continue
        tokens = reference[int(req[i])]
        if parts[i] and tokens.size:
            d = int(where[i])
            tail = arng.integers(1, 2**32, tokens.size - d, dtype=np.uint32)
            tail[0] ^= np.uint32(1) if tail[0] == tokens[d] else np.uint32(0)  # the first differs
            tokens = np.concatenate([tokens[:d], tail])
            diverged_at[i] = d
        fps.append(tokens)
        output_fp[i] = (
            int.from_bytes(hashlib.blake2b(tokens.tobytes(), digest_size=8).digest(), "little") or 1
        )
    return output_fp, _per_row(fps), diverged_at


def answer_text_of(tokens: Sequence[int]) -> str:
    """The synthetic text of an answer's tokens: each fingerprint's 8 hex digits and "·"."""
    return "".join(f"{int(t):08x}\u00b7" for t in tokens)


def _gaps(
    spec: SyntheticSpec, tpot: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """(itl_gaps_us per row, (mean, p50, p99, max) of each row's gaps in ms, NaN without gaps)
    for rows with ``tokens`` output tokens each (0 for a failed request): tokens - 1 gaps."""
    rng = np.random.default_rng([spec.seed, 14])  # a stream of its own, apart from generate()'s
    n = tokens.size
    lengths = np.maximum(tokens.astype(np.int64) - 1, 0)
    total = int(lengths.sum())
    row = np.repeat(np.arange(n), lengths)
    raw = rng.lognormal(0.0, spec.gap_sigma, total)
    spike = rng.random(total) < spec.gap_spike_rate
    raw = np.where(spike, raw * rng.uniform(2.0, 6.0, total), raw)
    safe = np.maximum(lengths, 1)
    mean_raw = np.bincount(row, weights=raw, minlength=n) / safe
    us = np.floor(tpot[row] * raw / mean_raw[row] * 1000.0 + 0.5).astype(np.uint32)  # mean gap = TPOT
    # each row's own statistics, as streaming.timing computes them (nearest rank, sorted per row)
    starts = np.cumsum(lengths) - lengths
    ordered = us[np.lexsort((us, row))].astype(np.float64) / 1000.0
    has = lengths > 0
    last = np.maximum(starts + lengths - 1, 0)

    def at(rank: np.ndarray) -> np.ndarray:
        return np.where(has, ordered[np.minimum(starts + rank - 1, last)] if total else np.nan, np.nan)

    mean = np.where(has, np.bincount(row, weights=us, minlength=n) / safe / 1000.0, np.nan)
    stats = (
        np.round(mean, spec.round_ms + 3),
        at((lengths + 1) // 2),  # ceil(0.5 n)
        at(-(-99 * lengths // 100)),  # ceil(0.99 n), in integers
        at(lengths),
    )
    return _per_row(np.split(us, starts[1:]) if n else []), stats


def _per_row(parts: Sequence[np.ndarray]) -> np.ndarray:
    """An object array holding one array per row (np.array would stack equal-length ones)."""
    out = np.empty(len(parts), dtype=object)
    for i, part in enumerate(parts):
        out[i] = part
    return out


def insert(store: Any, data: Synthetic, chunk_rows: int = 500_000) -> int:
    """Columnar insert of every row (duplicates included) in chunks; returns rows written.

    Through SampleStore.insert_columns (the columnar validator on these arrays; NaN in a
    nullable column is NULL): no dict per row is ever built, which 10M synthetic rows need.
    Duplicates stay physical until store.deduplicate() (the dedup contract, docs/report-json.md).
    """
    for chunk in data.chunks(chunk_rows):
        store.insert_columns(chunk)
    return data.n_rows
