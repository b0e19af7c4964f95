"""Answer fidelity against the simulator's truth: the identical-answer share's interval coverage,
and the first divergence positions exact end to end.

    .venv/bin/python bench/bench_fidelity.py            # 400 seeded runs, a mirror replay of 400 requests, ~1 min
    .venv/bin/python bench/bench_fidelity.py --quick    # 60 runs, a mirror replay of 120 requests, ~15 s

The simulator's profiles decide each greedy answer from the prompt alone (simulator/answers.py):
``fp16`` answers the reference, ``awq`` departs from it on 6% of answers and ``awq-fa2`` on 8%,
each request an independent draw keyed on the prompt and the profile's seed, at a position
uniform over its max_tokens. So the share of a variant's answers identical to fp16's is known
(0.94 and 0.92), and so is every answer's first divergence.

1. Coverage (pure: the answer model and the report's statistics, no server, no store). --runs
   seeded runs (400) of --requests requests (400) each: consecutive requests of the demo's
   chat-sized slice of the Azure code trace from a random start (their max_tokens, up to 32),
   users drawn as the replay draws them for a run (replay.users.UserPopulation with the run's
   seed: 5,000 users, Zipf 1.1, ~25 effective users in 400 requests), chat prompts as the
   replay builds them (replay.prompts.synth_words of the request's length) headed by a system
   message naming the run: every run asks other prompts, so it gets other draws (the same
   prompts would get the same answers in every run, and the 400 runs would be one). Each
   request is answered by simulator.answers for fp16, awq and awq-fa2; each answer is
   fingerprinted as the replay fingerprints a stream (fidelity.fingerprints: token_fp per token,
   output_fp of the text) and paired with fp16's as analysis.answer_fidelity's SQL pairs them
   (identical: the same output_fp; first divergence: the first token fingerprint that differs).
   The pairs become exactly what the report's one select returns (pairs_select: clusters, the
   largest, sums of n, s, n^2, n s, s^2 over user clusters, and the pairs by kind and position,
   read by kinds_of), which go to analysis.answer_fidelity.fidelity_entry, the report's own function
   (computed in Python, not on chDB: 1,600 store round trips would take minutes for the same
   numbers; part 2 runs the SQL). The truth, 1 - divergence_rate, is covered when
   lo <= truth <= hi of the entry's 95% interval (stats.clustered: a user-clustered share,
   Wilson at the effective sample size). Beside it, unchecked: the same runs with every request
   its own cluster (the experiment's analysis.cluster_by_user off).
2. End to end (the real path): the demo's document (workers/demo.py, three variants on the
   fp16/awq/awq-fa2 profiles, 4 engines each, chat API) against simulators served over HTTP in
   threads of this process, `manage.py replay KEY --mode mirror` (eager Celery: ShardRunner,
   greedy requests, fingerprinted streams, the sample writer) on the embedded store (SQLite and
   chDB in a fresh ABPLAT_VAR; --clickhouse-url for a ClickHouse server) over the first
   --replay-requests requests of the slice at --speed, then `manage.py sla_report KEY --run R
   --json` (analysis.answer_fidelity's SQL through analysis.readers.raw). The truth: every
   answer the simulators gave, recorded as simulator.answers.answer returns it to the app (the
   value the usage event's abplat.diverged_at carries), per profile.

Checks (else `bench FAILED`, exit 1). Part 1: every run's entry counts every pair compared,
its diverged count and its positions (as a multiset) are the simulator's, and every answer's
fingerprints part from fp16's exactly at the simulator's diverged_at; across all runs the share
of diverged answers is within 3.3 binomial standard errors of divergence_rate; the user-clustered
interval misses the truth no more often than a true 94% coverage allows (the 99.9% binomial
quantile for --runs runs: 400 runs fail with more than 40 misses, below 90%; the 94% target is
printed as met or not). Part 2: the store usable, the simulators healthy before and after; the run done with
every request ok and one sample per request and variant; each profile answered each request
once (fp16 never diverging, awq and awq-fa2 asked the same prompts and max_tokens as fp16); the
report's fp16 fidelity null, and for awq and awq-fa2: every pair compared (none failed or
unrecorded), positions in tokens, the identical and diverged counts and the first divergence
positions with their counts equal to the simulator's truth.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis import answer_fidelity as af  # noqa: E402
from bench.bench_capacity import migrate, require_healthy, setup_django  # noqa: E402
from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from fidelity.fingerprints import output_fp, token_fp  # noqa: E402
from replay.prompts import synth_words  # noqa: E402
from replay.users import UserPopulation  # noqa: E402
from simulator import answers  # noqa: E402
from simulator.profiles import get_profile  # noqa: E402

CONF = 0.95  # the report's (stats._common.DEFAULT_CONF)
REFERENCE = "fp16"
DIVERGING = ("awq", "awq-fa2")
TARGET = 0.94  # coverage of the 95% interval, the target
EXPERIMENT = "bench-fidelity"


def load_slice(path: Path) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) of the slice's requests (workers.demo.write_slice), in order."""
    with path.open(newline="", encoding="utf-8") as fh:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(fh)]


# --- 1. coverage: the answer model and the report's statistics --------------------------------


def first_divergence(ref: list[int], got: list[int]) -> int:
    """analysis.answer_fidelity's position: the first token fingerprint that differs, else where
    the shorter answer ends."""
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))


def report_rows(
    clusters: list[str], same: list[bool], positions: list[int]
) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    """What pairs_select returns for these pairs (after kinds_of) (every one compared, each
    streamed one token per chunk): per cluster n pairs and s identical, summed over clusters;
    pairs by position (-1: identical)."""
    per: dict[str, list[int]] = {}
    for c, s in zip(clusters, same):
        acc = per.setdefault(c, [0, 0])
        acc[0] += 1
        acc[1] += s
    n = np.array([v[0] for v in per.values()], float)
    s = np.array([v[1] for v in per.values()], float)
    moments = (len(per), int(n.max()), n.sum(), s.sum(), (n * n).sum(), (n * s).sum(), (s * s).sum())
    kinds = [(af.COMPARED, p, c, c) for p, c in sorted(Counter(positions).items())]
    return moments, kinds


def coverage(rows: list[tuple[int, int]], runs: int, requests: int, seed: int) -> dict[str, dict]:
    """Per diverging profile and unit: the runs' identical entries and the truth they are read
    against (module docstring, 1)."""
    ref_profile = get_profile(REFERENCE)
    profiles = {k: get_profile(k) for k in DIVERGING}
    out: dict[str, dict] = {
        k: {"truth": 1.0 - p.divergence_rate, "user": [], "request": [], "diverged": 0, "answers": 0}
        for k, p in profiles.items()
    }
    if len(rows) < requests:
        raise BenchFailed(f"--requests {requests}: the slice has only {len(rows)} requests")
    for run in range(runs):
        rng = random.Random(seed * 1_000_003 + run)
        start = rng.randrange(len(rows) - requests + 1)
        population = UserPopulation(seed=seed * 1_000_003 + run)
        users, pairs = [], {k: ([], []) for k in profiles}  # per profile: same, position
        truth_positions: dict[str, list[int]] = {k: [] for k in profiles}
        for i in range(requests):
            prompt_tokens, max_tokens = rows[start + i]
            messages = [
                {"role": "system", "content": f"{EXPERIMENT} seed {seed} run {run}"},
                {"role": "user", "content": synth_words(i, prompt_tokens)},
            ]
            key = answers.answer_key(
                answers.prompt_key(messages=messages), temperature=0, seed=None, request_id=""
            )
            ref = answers.answer(key, ref_profile, max_tokens)
            if ref.diverged_at is not None:
                raise BenchFailed(f"run {run}, request {i}: the reference diverged at {ref.diverged_at}")
            ref_fps, ref_fp = [token_fp(t) for t in ref.texts], output_fp(ref.texts)
            users.append(population.user_for(i))
            for k, p in profiles.items():
                got = answers.answer(key, p, max_tokens)
                same = output_fp(got.texts) == ref_fp
                pos = -1 if same else first_divergence(ref_fps, [token_fp(t) for t in got.texts])
                if (None if same else pos) != got.diverged_at:
                    raise BenchFailed(
                        f"run {run}, request {i}, {k}: the fingerprints part from fp16's at "
                        f"{None if same else pos}, the simulator says {got.diverged_at}"
                    )
                pairs[k][0].append(same)
                pairs[k][1].append(pos)
                if got.diverged_at is not None:
                    truth_positions[k].append(got.diverged_at)
        for k in profiles:
            same, positions = pairs[k]
            for unit, clusters in (("user", users), ("request", [str(i) for i in range(requests)])):
                moments, kinds = report_rows(clusters, same, positions)
                fid = af.fidelity_entry(moments, kinds, REFERENCE, CONF)
                check_run_entry(fid, requests, Counter(truth_positions[k]), f"run {run}, {k}, unit {unit}")
                out[k][unit].append(fid["identical"])
            out[k]["diverged"] += len(truth_positions[k])
            out[k]["answers"] += requests
    return out


def check_run_entry(fid: dict | None, requests: int, truth: Counter, where: str) -> None:
    if fid is None or fid["compared"] != requests or fid["failed"] or fid["unrecorded"]:
        raise BenchFailed(f"{where}: {requests} pairs, the entry says {fid and fid['compared']} compared")
    got = Counter(dict(zip(fid["first_divergence"]["positions"], fid["first_divergence"]["counts"])))
    if got != truth or fid["diverged"] != sum(truth.values()):
        raise BenchFailed(f"{where}: positions {dict(got)}, the simulator's {dict(truth)}")
    if fid["first_divergence"]["unit"] != af.POSITION_UNIT_TOKENS:
        raise BenchFailed(f"{where}: positions in {fid['first_divergence']['unit']}s, not tokens")


def tolerance(runs: int, rate: float) -> int:
    """Most misses among ``runs`` consistent with a true miss rate <= ``rate`` (99.9% binomial quantile)."""
    return int(sps.binom.ppf(0.999, runs, rate))


def coverage_table(cov: dict[str, dict], runs: int, requests: int) -> list[str]:
    rows = [
        f"Coverage of the identical-answer share's {CONF:.0%} interval: {runs} seeded runs of {requests} "
        f"requests, each answered by {REFERENCE} and the variant (simulator.answers), read by "
        "analysis.answer_fidelity.fidelity_entry; truth = 1 - divergence_rate. Coverage's own 95% "
        f"interval: Clopper-Pearson over the runs. Target >= {TARGET:.0%} (unit user, the report's default)",
        "",
        "| variant | truth | unit | covered | coverage [95% CI] | below / above | mean width | "
        "sd of estimates | median se | clusters (median) | effective clusters (median) | heaviest (median) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, c in cov.items():
        truth = c["truth"]
        for unit in ("user", "request"):
            ids = c[unit]
            lo = np.array([x["lo"] for x in ids])
            hi = np.array([x["hi"] for x in ids])
            est = np.array([x["estimate"] for x in ids])
            se = np.array([x["se"] for x in ids])
            below, above = int((hi < truth).sum()), int((lo > truth).sum())
            covered = runs - below - above
            ci = sps.binomtest(covered, runs).proportion_ci(0.95, method="exact")
            clusters = np.median([x["clusters"] for x in ids])
            eff = np.median([x["effective_clusters"] for x in ids])
            heavy = np.median([x["largest_cluster_share"] for x in ids])
            rows.append(
                f"| {k} | {truth:.2f} | {unit} | {covered}/{runs} | {covered / runs:.2%} "
                f"[{ci.low:.1%}, {ci.high:.1%}] | {below} / {above} | {np.mean(hi - lo):.4f} | "
                f"{np.std(est, ddof=1):.4f} | {np.median(se):.4f} | {clusters:.0f} | {eff:.1f} | {heavy:.1%} |"
            )
    rows += ["", "Targets, and the simulator's draws pooled over every run:"]
    for k, c in cov.items():
        ids = c["user"]
        missed = sum(not (x["lo"] <= c["truth"] <= x["hi"]) for x in ids)
        rate, n = c["diverged"] / c["answers"], c["answers"]
        p = 1.0 - c["truth"]
        z = (rate - p) / math.sqrt(p * (1 - p) / n)
        rows.append(
            f"- {k}: coverage {(runs - missed) / runs:.2%} (unit user): "
            f"{'met' if runs - missed >= TARGET * runs else 'NOT met'} (>= {TARGET:.0%}"
            f"{'' if runs >= 400 else f'; only {runs} runs: judge by the interval above'}); "
            f"{c['diverged']:,} of {n:,} answers diverged, {rate:.4%} against divergence_rate {p:.2%} "
            f"(z = {z:+.2f})"
        )
        if abs(z) > 3.3:
            raise BenchFailed(f"{k}: {rate:.4%} of answers diverged, divergence_rate {p:.2%} (z = {z:+.2f})")
        tol = tolerance(runs, 1.0 - TARGET)
        if missed > tol:
            raise BenchFailed(
                f"{k}: the user-clustered interval missed the truth in {missed} of {runs} runs "
                f"(tolerance {tol} for a true coverage of {TARGET:.0%})"
            )
    return rows


# --- 2. end to end: a mirror replay through the simulators, the report against the truth ------


class AnswerLog:
    """Every answer the simulators in this process give: simulator.answers.answer wrapped while
    the replay runs, its (answer key, max_tokens, diverged_at) kept per profile."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[str, int, int | None]]] = {}
        self._lock = threading.Lock()
        self._real = answers.answer

    def __enter__(self) -> AnswerLog:
        real = self._real

        def recording(key: str, profile: Any, max_tokens: int) -> answers.Answer:
            got = real(key, profile, max_tokens)
            with self._lock:
                self.calls.setdefault(profile.name, []).append((key, max_tokens, got.diverged_at))
            return got

        answers.answer = recording
        return self

    def __exit__(self, *exc: object) -> None:
        answers.answer = self._real


def start_simulators(doc: dict, replicas: int) -> list:
    """A simulator per variant in a thread of this process (so AnswerLog sees its answers), as
    `manage.py simulator --experiment` serves it; each endpoint written back to ``doc``."""
    from simulator.experiment import served_variants
    from simulator.serve import start_in_thread

    sims = []
    try:
        for variant, served in zip(doc["variants"], served_variants(doc["variants"])):
            handle = start_in_thread(served.profile, port=0, model=served.model, replicas=replicas)
            variant["endpoint"] = handle.url + "/v1"
            sims.append(handle)
    except BaseException:
        for handle in sims:
            handle.stop()
        raise
    return sims


def command_json(*args: str) -> dict:
    """A management command's --json document; BenchFailed with its output when it fails."""
    from django.core.management import CommandError, call_command

    out, err = io.StringIO(), io.StringIO()
    try:
        call_command(*args, "--json", stdout=out, stderr=err)
    except (CommandError, SystemExit) as exc:
        raise BenchFailed(f"manage.py {' '.join(args)} failed ({exc}): {out.getvalue()[-2000:]}") from None
    return json.loads(out.getvalue())


def mirror_replay(args: argparse.Namespace, cut: Path) -> tuple[dict, dict, AnswerLog]:
    """(the replay's --json run, the sla_report --json document, the simulators' answers)."""
    from experiments import services
    from workers import demo

    doc = demo.load_document(demo.REPLICAS)
    doc["key"] = EXPERIMENT
    keys = [v["key"] for v in doc["variants"]]
    if keys[0] != REFERENCE or set(keys[1:]) != set(DIVERGING):
        raise BenchFailed(f"{demo.DOCUMENT}: variants {keys}, expected {REFERENCE} (control) and {DIVERGING}")
    sims = start_simulators(doc, demo.REPLICAS)
    try:
        require_healthy(sims, "before the replay")
        experiment = services.apply_document(doc).experiment
        if experiment.status != "running":
            services.transition(
                experiment, "start" if experiment.status == "draft" else "resume", None, reason="bench"
            )
        with AnswerLog() as log:
            replayed = command_json(
                "replay",
                EXPERIMENT,
                "--trace",
                str(cut),
                "--mode",
                "mirror",
                "--speed",
                f"{args.speed:g}",
                "--limit",
                str(args.replay_requests),
                "--no-progress",
            )
        require_healthy(sims, "after the replay")
    finally:
        for h in sims:
            h.stop()
    run = replayed["run"]
    want = args.replay_requests * len(keys)
    if run["status"] != "done" or run["outcomes"] != {"ok": want} or run["samples_recorded"] != want:
        raise BenchFailed(
            f"replay run {run['run']}: status {run['status']}, outcomes {run['outcomes']}, "
            f"{run['samples_recorded']} samples; expected done, ok={want}, {want} samples ({run['error']})"
        )
    report = command_json("sla_report", EXPERIMENT, "--run", str(run["run"]))
    return run, report, log


def truth_of(log: AnswerLog, requests: int) -> dict[str, dict]:
    """Per diverging profile: identical and diverged counts and the positions, from the answers
    the simulators gave (every request answered once by each profile, fp16 the reference)."""
    asked = {}
    for name in (REFERENCE, *DIVERGING):
        calls = log.calls.get(name, [])
        if len(calls) != requests:
            raise BenchFailed(f"the {name} simulator answered {len(calls)} times, for {requests} requests")
        asked[name] = Counter((key, max_tokens) for key, max_tokens, _ in calls)
    if any(at is not None for _, _, at in log.calls[REFERENCE]):
        raise BenchFailed(f"the {REFERENCE} simulator's answers diverged from the reference")
    out = {}
    for name in DIVERGING:
        if asked[name] != asked[REFERENCE]:
            raise BenchFailed(f"{name} was asked other prompts or max_tokens than {REFERENCE}")
        positions = Counter(at for _, _, at in log.calls[name] if at is not None)
        diverged = sum(positions.values())
        out[name] = {"identical": requests - diverged, "diverged": diverged, "positions": positions}
    return out


def e2e_table(report: dict, truth: dict[str, dict], requests: int, run: dict) -> list[str]:
    fids = {v["key"]: v.get("fidelity") for v in report["variants"]}
    if fids.get(REFERENCE) is not None:
        raise BenchFailed(f"the report compares {REFERENCE}, the control, with itself")
    rows = [
        f"End to end: a mirror replay (run {run['run']}) of the slice's first {requests} requests to "
        f"{REFERENCE}, awq and awq-fa2 over HTTP (the demo's document, 4 engines each, chat), "
        "the report (sla_report --json, chDB unless --clickhouse-url) against the simulators' truth",
        "",
        "| variant | compared | failed / unrecorded | identical: report / truth | diverged: report / truth "
        "| positions exact | identical share [95% CI] | median / p90 position | unit |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    problems, lines = [], []
    for k in DIVERGING:
        fid, want = fids.get(k), truth[k]
        if fid is None or fid["identical"] is None:
            raise BenchFailed(f"the report has no fidelity for {k}")
        pos = fid["first_divergence"]
        got = Counter(dict(zip(pos["positions"], pos["counts"])))
        ident = fid["identical"]
        identical = round(ident["estimate"] * fid["compared"])
        if not math.isclose(identical, ident["estimate"] * fid["compared"], abs_tol=1e-6):
            problems.append(f"{k}: identical share {ident['estimate']} of {fid['compared']} is no count")
        matched = sum((got & want["positions"]).values())
        exact = got == want["positions"]
        lines.append(f"positions exact ({k}): {'yes' if exact else 'no'} ({matched} of {want['diverged']})")
        rows.append(
            f"| {k} | {fid['compared']} | {fid['failed']} / {fid['unrecorded']} | {identical} / "
            f"{want['identical']} | {fid['diverged']} / {want['diverged']} | {'yes' if exact else 'NO'} "
            f"({matched} of {want['diverged']}) | {ident['estimate']:.2%} [{ident['lo']:.2%}, {ident['hi']:.2%}] "
            f"| {pos['median']} / {pos['p90']} | {pos['unit']} |"
        )
        if (fid["compared"], fid["failed"], fid["unrecorded"]) != (requests, 0, 0):
            problems.append(
                f"{k}: {fid['compared']} compared, {fid['failed']} failed, {fid['unrecorded']} unrecorded"
            )
        if identical != want["identical"] or fid["diverged"] != want["diverged"]:
            problems.append(
                f"{k}: identical {identical}, diverged {fid['diverged']}; the truth {want['identical']}, "
                f"{want['diverged']}"
            )
        if not exact:
            problems.append(
                f"{k}: positions {dict(sorted(got.items()))}, the truth {dict(sorted(want['positions'].items()))}"
            )
        if pos["unit"] != af.POSITION_UNIT_TOKENS:
            problems.append(f"{k}: positions in {pos['unit']}s, not tokens")
    if problems:
        raise BenchFailed("the report against the simulator's truth: " + "; ".join(problems))
    return [*rows, "", *lines]


def revision() -> str:
    """HEAD's short hash, and the code this bench measures that the tree changes beside it."""

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    measured = (
        "analysis",
        "dashboards",
        "fidelity",
        "replay",
        "samples",
        "simulator",
        "stats",
        "streaming",
        "workers",
    )
    changed = sorted(
        {
            line.split()[-1].split("/")[0]
            for line in git("status", "--porcelain", "--", *measured).splitlines()
        }
    )
    return git("rev-parse", "--short", "HEAD") + (
        f" (uncommitted changes under {', '.join(changed)})" if changed else ""
    )


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 runs, a replay of 120 requests")
    parser.add_argument("--runs", type=int, help="seeded coverage runs (default 400; --quick 60)")
    parser.add_argument("--requests", type=int, default=400, help="requests per coverage run (default 400)")
    parser.add_argument(
        "--replay-requests", type=int, help="requests of the mirror replay (default 400; --quick 120)"
    )
    parser.add_argument(
        "--speed", type=float, default=100.0, help="the replay's time compression (default 100)"
    )
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--clickhouse-url", help="a ClickHouse server for part 2 (default: chDB, embedded)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (60 if args.quick else 400)
    args.replay_requests = args.replay_requests or (120 if args.quick else 400)
    if args.runs < 20 or args.requests < 50 or not 10 <= args.replay_requests <= 1463 or args.speed <= 0:
        raise BenchFailed(
            "--runs at least 20, --requests at least 50, --replay-requests 10 to 1463, --speed > 0"
        )
    t0 = time.perf_counter()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    setup_django(args)
    migrate(args)
    from workers import demo

    cut = demo.write_slice(ROOT / demo.TRACE, Path(os.environ["ABPLAT_VAR"]) / "demo")
    t1 = time.perf_counter()
    cov = coverage(load_slice(cut.path), args.runs, args.requests, args.seed)
    cov_rows = coverage_table(cov, args.runs, args.requests)
    t2 = time.perf_counter()
    replayed, report, log = mirror_replay(args, cut.path)
    e2e_rows = e2e_table(report, truth_of(log, args.replay_requests), args.replay_requests, replayed)
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} cores, seed {args.seed}, "
        f"at {revision()}, {started}"
    )
    print(f"the demo's slice: {cut.describe()} of {demo.TRACE}; store set up in {t1 - t0:.0f} s")
    print()
    print("\n".join(cov_rows))
    print(f"({t2 - t1:.0f} s)")
    print()
    print("\n".join(e2e_rows))
    print(f"({time.perf_counter() - t2:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
