"""Latency model of a continuous-batching LLM server (vLLM-like), with no I/O.

The engine runs in steps. Before each step the scheduler admits waiting sequences while fewer
than ``max_num_seqs`` run; one step then prefills the admitted prompts (all of each prompt, or
at most ``chunked_prefill_tokens`` per step in total when chunked prefill is on) and decodes one
token for every running sequence. A sequence whose prefill completes samples its first token in
that same step, as vLLM V1 does. Step time grows with prefill tokens and with batch size:

    step_ms = decode_base_ms + decode_ms_per_seq * batch + [prefill_base_ms + prefill_ms_per_token * n]

so TTFT grows with load (queueing for a slot, longer steps) and with prompt length. The same
``Scheduler`` runs on a virtual clock (``simulate``, for calibration and tests) and on the real
clock (``simulator.runtime``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class Faults:
    """Per-request probabilities; a request draws at most one fault (seeded by its id)."""

    http_error_rate: float = 0.0  # HTTP 500 before any byte of the stream
    engine_error_rate: float = 0.0  # HTTP 200, then vLLM's data: {"error": ...} mid-stream
    stall_rate: float = 0.0  # a pause of stall_ms between two tokens
    stall_ms: float = 3000.0
    disconnect_rate: float = 0.0  # the connection drops mid-stream
    malformed_rate: float = 0.0  # an event whose data is not valid JSON
    split_utf8_rate: float = 0.0  # multi-byte characters written across two writes (valid)
    slow_headers_rate: float = 0.0  # response headers held back by slow_headers_ms
    slow_headers_ms: float = 3000.0
    # Appended kinds: the draw walks KINDS in order, so the older kinds keep their requests.
    rate_limited_rate: float = 0.0  # HTTP 429 before any byte of the stream (a gateway's limit)
    slow_first_token_rate: float = 0.0  # headers at once, first token held by slow_first_token_ms
    slow_first_token_ms: float = 3000.0

    KINDS = (
        "http_error",
        "engine_error",
        "stall",
        "disconnect",
        "malformed",
        "split_utf8",
        "slow_headers",
        "rate_limited",
        "slow_first_token",
    )

    def __post_init__(self) -> None:
        total = 0.0
        for kind in self.KINDS:
            rate = getattr(self, f"{kind}_rate")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"Faults.{kind}_rate={rate}: must be within [0, 1]")
            total += rate
        if total > 1.0:
            raise ValueError(f"Faults: the rates add up to {total:.3f}, more than 1")
        for name in ("stall_ms", "slow_headers_ms", "slow_first_token_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"Faults.{name}: must not be negative")

    def draw(self, u: float) -> str:
        """The fault for a request whose uniform draw is ``u`` ("" for none)."""
        acc = 0.0
        for kind in self.KINDS:
            acc += getattr(self, f"{kind}_rate")
            if u < acc:
                return kind
        return ""


KV_BLOCK_TOKENS = 16  # vLLM's default KV-cache block size


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    name: str
    prefill_ms_per_token: float
    prefill_base_ms: float
    decode_base_ms: float
    decode_ms_per_seq: float
    max_num_seqs: int = 256
    chunked_prefill_tokens: int = 0  # 0: whole prompts in one step; else token budget per step
    max_model_len: int = 8192
    seed: int = 0
    empty_token_rate: float = 0.0  # tokens that decode to "" (real vLLM does this)
    multibyte_rate: float = 0.0  # tokens that are CJK or emoji
    # The share of requests whose answer departs from the reference answer (simulator/answers.py).
    divergence_rate: float = 0.0
    # How much a numerical change perturbs the model's logits: the standard deviation, in nats, of
    # the noise added to the reference's (simulator/logprobs.py; 0 for the reference itself).
    logit_noise: float = 0.0
    faults: Faults = Faults()
    description: str = ""
    # The KV cache's size in tokens, for vllm:kv_cache_usage_perc only (blocks the running
    # sequences hold / blocks of this size); admission is bounded by max_num_seqs, not by it.
    kv_cache_tokens: int = 262144

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "prefill_base_ms", "decode_base_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"Profile {self.name!r}: {name} must not be negative")
        if self.decode_ms_per_seq < 0:
            raise ValueError(f"Profile {self.name!r}: decode_ms_per_seq must not be negative")
        if self.max_num_seqs < 1:
            raise ValueError(f"Profile {self.name!r}: max_num_seqs must be at least 1")
        if self.chunked_prefill_tokens < 0:
            raise ValueError(f"Profile {self.name!r}: chunked_prefill_tokens must be >= 0")
        for name in ("empty_token_rate", "multibyte_rate", "divergence_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"Profile {self.name!r}: {name}={rate!r} must be within [0, 1]")
        if not 0.0 <= self.logit_noise < math.inf:
            raise ValueError(
                f"Profile {self.name!r}: logit_noise={self.logit_noise!r} must be a finite number >= 0"
            )
        if self.kv_cache_tokens < KV_BLOCK_TOKENS:
            raise ValueError(f"Profile {self.name!r}: kv_cache_tokens must be at least {KV_BLOCK_TOKENS}")

    def step_ms(self, batch: int, prefill_tokens: int) -> float:
        ms = self.decode_base_ms + self.decode_ms_per_seq * batch
        if prefill_tokens:
            ms += self.prefill_base_ms + self.prefill_ms_per_token * prefill_tokens
        return ms


@dataclasses.dataclass(eq=False, slots=True)
class Seq:
    prompt_tokens: int
    max_tokens: int
    arrival: float = 0.0  # seconds, on whichever clock drives the scheduler
    prefilled: int = 0
    generated: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    handle: object = None  # the runtime's per-request object; opaque here

    @property
    def finished(self) -> bool:
        return self.generated >= self.max_tokens or self.aborted


@dataclasses.dataclass(slots=True)
class Step:
    duration_s: float
    batch: list[Seq]
    prefill: list[tuple[Seq, int]]  # (seq, prompt tokens prefilled in this step)


class Scheduler:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []

    def add(self, seq: Seq) -> None:
        if seq.max_tokens < 1:
            raise ValueError(f"Seq.max_tokens={seq.max_tokens}: must be at least 1")
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        seq.aborted = True  # dropped from running/waiting at the next plan()

    def kv_cache_usage(self) -> float:
        """Share of the KV cache (Profile.kv_cache_tokens) the running sequences hold, in whole
        blocks of KV_BLOCK_TOKENS, as vLLM's vllm:kv_cache_usage_perc (1 means full)."""
        blocks = sum(
            -(-(s.prefilled + s.generated) // KV_BLOCK_TOKENS) for s in self.running if not s.aborted
        )
        return min(1.0, blocks * KV_BLOCK_TOKENS / self.profile.kv_cache_tokens)

    def plan(self, now: float) -> Step | None:
        p = self.profile
        # 1. Drop aborted sequences, then admit from the queue while there is a free slot.
        if any(s.aborted for s in self.running):
            self.running = [s for s in self.running if not s.aborted]
        while self.waiting and len(self.running) < p.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.aborted:
                continue
            seq.admitted_at = now
            self.running.append(seq)
        if not self.running:
            return None
        # 2. Share out prefill tokens: whole prompts, or a per-step budget (chunked prefill).
        budget = p.chunked_prefill_tokens or None
        prefill: list[tuple[Seq, int]] = []
        n_prefill = 0
        for seq in self.running:
            left = seq.prompt_tokens - seq.prefilled
            if left <= 0:
                continue
            take = left if budget is None else min(left, budget - n_prefill)
            if take <= 0:
                break
            prefill.append((seq, take))
            n_prefill += take
        decoding = sum(1 for s in self.running if s.prefilled >= s.prompt_tokens)
        duration = p.step_ms(decoding + len(prefill), n_prefill) / 1000.0
        return Step(duration, list(self.running), prefill)

    def complete(self, step: Step, now: float) -> list[Seq]:
        """Apply a planned step that ended at ``now``; return the sequences that got a token."""
        for seq, n in step.prefill:
            seq.prefilled += n
        emitted: list[Seq] = []
        for seq in step.batch:
            if seq.aborted or seq.prefilled < seq.prompt_tokens:
                continue
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.generated >= seq.max_tokens:
                seq.finished_at = now
            emitted.append(seq)
        self.running = [s for s in self.running if not s.finished]
        return emitted


def simulate(profile: Profile, arrivals: Iterable[tuple[float, int, int]]) -> list[Seq]:
    """Run the scheduler on a virtual clock. arrivals: (time_s, prompt_tokens, max_tokens)."""
    pending = sorted(arrivals)
    seqs = [Seq(prompt_tokens=p, max_tokens=m, arrival=t) for t, p, m in pending]
    heap = [(s.arrival, i) for i, s in enumerate(seqs)]
    heapq.heapify(heap)
    sched = Scheduler(profile)
    now = 0.0
    while heap or sched.running or sched.waiting:
        while heap and heap[0][0] <= now:
            sched.add(seqs[heapq.heappop(heap)[1]])
        step = sched.plan(now)
        if step is None:
            now = heap[0][0]
            continue
        now += step.duration_s
        sched.complete(step, now)
    return seqs


def poisson_arrivals(
    rate_per_s: float, n: int, prompt_tokens: int, max_tokens: int, seed: int = 0
) -> list[tuple[float, int, int]]:
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s={rate_per_s}: must be positive")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append((t, prompt_tokens, max_tokens))
    return out


# The "moderate load" the profiles are calibrated at (see tests/simulator/test_model.py):
# Poisson arrivals at 4 requests/s, 512-token prompts, 128 output tokens.
MODERATE_LOAD = {"rate_per_s": 4.0, "prompt_tokens": 512, "max_tokens": 128}
