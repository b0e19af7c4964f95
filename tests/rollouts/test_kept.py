"""A rollout step read through its kept per-user sums (rollouts.kept) reads what reading every
request of the step again reads, look after look, whatever happened in between: samples arriving,
a row stored after its recorded time passed the watermark, a duplicate recording removed, a fold
that stopped half-way, an SLO changed, the kept rows compacted. And once kept, a look reads only
the samples recorded after the watermark (and counts the rest)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from analysis.definitions import Slo
from rollouts import kept
from rollouts.controller import Plan
from rollouts.readings import read_step
from samples.schema import ROLLOUT_FOLDS_TABLE, ROLLOUT_SUMS_INDEX_PREFIX, ROLLOUT_USER_SUMS_TABLE
from stats.sequential.guardrail_spec import Guardrail
from tests.rollouts.test_readings import RUN, step_samples

pytestmark = pytest.mark.services

T0 = 1_750_000_000_000  # the step's first recorded_ms
MIN = 60_000
LAG = 2 * MIN  # the kept sums' lag the looks below are timed for (not the default's 30 s)
SLO = Slo(200.0)


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)


PLAN = Plan(
    candidate="cand",
    control="base",
    steps=(5, 50, 100),
    min_samples=100,
    min_duration_s=0.0,
    guardrails=(Guardrail("p99_ttft_ms", "at_most", 1000.0),),
    on_breach="rollback",
    notify=(),
    alpha=0.05,
)


def samples(exp: str, rev: int, seed: int, start_ms: int, minutes: float, run: int = RUN + 40) -> dict:
    """A step's samples (tests/rollouts/test_readings.step_samples: heavy-tailed users, requests
    without a user, errors) recorded over ``minutes`` from ``start_ms`` (each sent 1-30 s
    before), with setup errors and
    live retries on the control (not assigned by the router)."""
    c = step_samples(exp, rev, seed=seed, run_id=run)
    rng = np.random.default_rng(seed + 100)
    n = len(c["variant"])
    c["recorded_ms"] = (start_ms + rng.random(n) * minutes * MIN).astype(np.uint64)
    c["sent_at"] = (c["recorded_ms"] // 1000 - rng.integers(1, 30, n).astype(np.uint64)).astype(np.uint32)
    setup = rng.random(n) < 0.03
    c["outcome"] = np.where(setup, "http_4xx", c["outcome"]).astype(object)
    c["http_status"] = np.where(setup, 400, c["http_status"]).astype(np.uint16)
    retry = (rng.random(n) < 0.05) & (c["variant"] == "base")
    c["mode"] = np.where(retry, "live", c["mode"]).astype(object)
    c["attempt"] = np.where(retry, 2, c["attempt"]).astype(np.uint8)
    return c


def same(a, b) -> None:
    """Two StepReadings read the same: counts, users, setup errors, histograms exactly; the
    per-user moments to 1e-9."""
    assert a.error == b.error == ""
    assert a.users == b.users
    for x, y in ((a.control, b.control), (a.candidate, b.candidate)):
        assert (x.n, x.hits, x.errors, x.setup_errors) == (y.n, y.hits, y.errors, y.setup_errors)
        assert set(x.latencies) == set(y.latencies) == {"ttft_ms"}
        for name in x.latencies:
            np.testing.assert_array_equal(x.latencies[name].counts, y.latencies[name].counts)
        for metric in ("attainment", "error_rate"):
            p, q = getattr(x.per_user, metric), getattr(y.per_user, metric)
            assert (p is None) == (q is None)
            if p is not None:
                assert (p.clusters, p.largest, p.n) == (q.clusters, q.largest, q.n)
                np.testing.assert_allclose(p.total, q.total, rtol=1e-9)
                np.testing.assert_allclose(p.cross, q.cross, rtol=1e-9)


def look(store, exp, rev, now_ms, slo=SLO, plan=PLAN, **kw):
    """The kept reading at now_ms and the whole one, checked equal; the kept one returned."""
    kw.setdefault("keep_lag_ms", LAG)
    got = read_step(store, exp, rev, plan, slo, keep=True, now_ms=now_ms, **kw)
    same(got, read_step(store, exp, rev, plan, slo, keep=False))
    return got


def step(store, exp, rev, slo=SLO):
    return kept.KeptStep(store, exp, rev, (PLAN.control, PLAN.candidate), slo, PLAN.latencies())


def state(store, exp, rev, slo=SLO):
    return step(store, exp, rev, slo).newest()


def test_looks_as_samples_arrive_read_as_the_whole_step(store):
    exp, rev = "kept-arrive", 3
    store.insert_columns(samples(exp, rev, 1, T0, 10))
    store.insert_columns(samples(exp, rev + 1, 2, T0, 10, run=RUN + 41))  # the next step's: not read
    first = look(store, exp, rev, T0)  # nothing old enough to keep: all of it read as new
    assert first.control.n > 1000 and first.candidate.per_user.attainment.clusters > 50
    s = state(store, exp, rev)
    assert s is None or s.rows == 0
    look(store, exp, rev, T0 + 7 * MIN)  # the first 5 minutes kept
    s = state(store, exp, rev)
    assert s.upto_ms == T0 + 5 * MIN and 0 < s.rows < 4000
    # more samples, some from users already kept; then looks a minute apart, each folding
    store.insert_columns(samples(exp, rev, 3, T0 + 10 * MIN, 5, run=RUN + 42))
    for m in (12, 13, 14, 30):
        look(store, exp, rev, T0 + m * MIN)
    s2 = state(store, exp, rev)
    assert s2.generation == s.generation and s2.fold == s.fold + 4 and s2.upto_ms == T0 + 28 * MIN
    assert s2.rows == 8000  # every sample of the step kept
    # a look between folds (watermark moves less than FOLD_EVERY_MS) writes nothing
    look(store, exp, rev, T0 + 30 * MIN + 10_000)
    assert state(store, exp, rev).fold == s2.fold


def test_a_row_stored_after_the_watermark_passed_it_is_counted(store):
    exp, rev = "kept-late", 4
    store.insert_columns(samples(exp, rev, 4, T0, 10))
    look(store, exp, rev, T0 + 20 * MIN)
    before = state(store, exp, rev)
    late = samples(exp, rev, 5, T0 + 2 * MIN, 1, run=RUN + 43)  # recorded long before the watermark
    store.insert_columns({k: v[:50] for k, v in late.items()})
    got = look(store, exp, rev, T0 + 20 * MIN + 1000)
    after = state(store, exp, rev)
    assert after.generation != before.generation and after.rows == before.rows + 50
    assert got.control.n + got.candidate.n + got.control.setup_errors + got.candidate.setup_errors == 4050


def test_the_sums_are_kept_as_far_behind_now_as_the_lag_says(store):
    exp, rev = "kept-lag", 12
    store.insert_columns(samples(exp, rev, 20, T0, 10))
    look(store, exp, rev, T0 + 10 * MIN, keep_lag_ms=30_000)
    s = state(store, exp, rev)
    assert s.upto_ms == T0 + 10 * MIN - 30_000 and 3000 < s.rows < 4000
    # a row recorded 20 s before the watermark and stored after the fold: later than the lag,
    # so the sums are built again, the row in them
    late = samples(exp, rev, 21, T0 + 10 * MIN - 50_000, 1 / 3, run=RUN + 47)
    store.insert_columns({k: v[:20] for k, v in late.items()})
    look(store, exp, rev, T0 + 10 * MIN + 1000, keep_lag_ms=30_000)
    rebuilt = state(store, exp, rev)
    assert rebuilt.generation != s.generation and rebuilt.upto_ms == T0 + 10 * MIN - 29_000
    # the lag raised to 2 minutes: now less it is behind the watermark; nothing is folded, what
    # was recorded after the watermark is read
    look(store, exp, rev, T0 + 11 * MIN)
    assert state(store, exp, rev).fold == rebuilt.fold
    # lowered to 5 s: everything kept
    look(store, exp, rev, T0 + 12 * MIN, keep_lag_ms=5_000)
    assert state(store, exp, rev).rows == 4020


def test_a_negative_lag_is_refused():
    with pytest.raises(ValueError, match="lag must be 0 ms or more, not -1"):
        kept.KeptStep(None, "e", 1, ("a", "b"), SLO, ("ttft_ms",), lag_ms=-1)


def test_a_duplicate_recording_removed_after_the_fold_is_no_longer_counted(store):
    exp, rev = "kept-dup", 5
    c = samples(exp, rev, 6, T0, 10)
    store.insert_columns(c)
    dup = {k: v[:30] for k, v in c.items()}  # the same requests written again (a retried insert)
    store.insert_columns(dup)
    look(store, exp, rev, T0 + 20 * MIN)  # both copies kept, as the whole read counts them now
    assert state(store, exp, rev).rows == 4030
    store.deduplicate()
    look(store, exp, rev, T0 + 20 * MIN + 1000)
    assert state(store, exp, rev).rows == 4000


def test_a_fold_that_stopped_before_its_state_is_built_again(store, monkeypatch):
    exp, rev = "kept-crash", 6
    store.insert_columns(samples(exp, rev, 7, T0, 10))
    look(store, exp, rev, T0 + 6 * MIN)
    s = state(store, exp, rev)

    def crash(self, st):
        raise RuntimeError("killed between the fold's two writes")

    monkeypatch.setattr(kept.KeptStep, "_write_state", crash)
    with pytest.raises(RuntimeError):
        read_step(store, exp, rev, PLAN, Slo(200.0), keep=True, now_ms=T0 + 20 * MIN, keep_lag_ms=LAG)
    monkeypatch.undo()
    # the fold's user sums are there, its state is not: never counted twice
    assert (
        store.query(
            f"SELECT max(fold) FROM {ROLLOUT_USER_SUMS_TABLE} WHERE experiment = %(e)s AND generation = %(g)s",
            {"e": exp, "g": s.generation},
        )[0][0]
        == s.fold + 1
    )
    assert state(store, exp, rev) is None
    look(store, exp, rev, T0 + 20 * MIN)
    assert state(store, exp, rev).generation != s.generation


def test_another_slo_keeps_sums_of_its_own(store):
    exp, rev = "kept-slo", 7
    store.insert_columns(samples(exp, rev, 8, T0, 10))
    a = look(store, exp, rev, T0 + 20 * MIN, Slo(200.0))
    b = look(store, exp, rev, T0 + 20 * MIN, Slo(50.0))
    assert b.control.hits < a.control.hits
    assert state(store, exp, rev, Slo(50.0)) is not None


def test_a_generation_of_many_folds_is_compacted(store, monkeypatch):
    exp, rev = "kept-compact", 8
    monkeypatch.setattr(kept, "COMPACT_MIN", 100)
    store.insert_columns(samples(exp, rev, 9, T0, 30))
    first = None
    for m in range(3, 34):
        look(store, exp, rev, T0 + m * MIN)
        s = state(store, exp, rev)
        first = first or s.generation
        assert s.entries <= max(kept.COMPACT_MIN, kept.COMPACT_ABOVE * s.units)
    assert s.generation != first and s.rows == 4000
    per_unit = store.query(
        f"SELECT count(), uniqExact(cluster) FROM {ROLLOUT_USER_SUMS_TABLE} "
        "WHERE experiment = %(e)s AND generation = %(g)s",
        {"e": exp, "g": s.generation},
    )[0]
    assert per_unit[0] <= kept.COMPACT_ABOVE * per_unit[1]


class Spy:
    """The store, with every SELECT's SQL (and its parameters) recorded."""

    def __init__(self, store):
        self.store, self.sql, self.params = store, [], []

    def query_columns(self, sql, params=None, *, settings=None):
        self.sql.append(sql)
        self.params.append(params or {})
        return self.store.query_columns(sql, params, settings=settings)

    def execute(self, sql, params=None):
        self.sql.append(sql)
        self.params.append(params or {})
        return self.store.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self.store, name)


def step_parts(store, exp) -> set[str]:
    return {
        r[0] for r in store.query("SELECT DISTINCT _part FROM samples WHERE experiment = %(e)s", {"e": exp})
    }


def test_a_look_after_the_fold_reads_only_the_parts_written_since(store):
    exp, rev = "kept-cost", 9
    store.insert_columns(samples(exp, rev, 10, T0, 10))
    look(store, exp, rev, T0 + 20 * MIN)
    kept_parts = step_parts(store, exp)
    assert kept_parts and kept_parts <= set(state(store, exp, rev).parts)
    store.insert_columns(samples(exp, rev, 17, T0 + 19 * MIN, 0.5, run=RUN + 46))  # after the watermark
    new_parts = step_parts(store, exp) - kept_parts
    assert new_parts
    spy = Spy(store)
    got = read_step(spy, exp, rev, PLAN, Slo(200.0), keep=True, now_ms=T0 + 20 * MIN + 1000, keep_lag_ms=LAG)
    same(got, read_step(store, exp, rev, PLAN, Slo(200.0), keep=False))
    assert not any(q.startswith("INSERT") for q in spy.sql)  # nothing to fold
    # every read of the samples (the new rows grouped by unit, their histograms, the check's
    # count) skips the parts whose rows are all kept: what it reads is the part written since
    on_samples = [(q, p) for q, p in zip(spy.sql, spy.params, strict=True) if "FROM samples" in q]
    assert len(on_samples) >= 3
    for q, p in on_samples:
        assert "_part NOT IN %(settled)s" in q and kept_parts <= set(p["settled"]), q
        assert not new_parts & set(p["settled"])
    assert any(q.startswith("SELECT _part AS part") for q, _ in on_samples)  # the check


def test_rows_that_keep_arriving_late_fall_back_to_reading_the_whole_step(store, monkeypatch):
    exp, rev = "kept-stale", 10
    store.insert_columns(samples(exp, rev, 11, T0, 10))
    plain = read_step(store, exp, rev, PLAN, Slo(200.0), keep=False)
    calls = []

    def stale(self, now_ms):
        calls.append(now_ms)
        raise kept.KeptStale("late rows")

    monkeypatch.setattr(kept.KeptStep, "read", stale)
    got = read_step(store, exp, rev, PLAN, Slo(200.0), keep=True, now_ms=T0 + 20 * MIN, keep_lag_ms=LAG)
    assert calls == [T0 + 20 * MIN]
    same(got, plain)


def test_the_kept_check_gives_up_after_two_disagreements(store, monkeypatch):
    exp, rev = "kept-late-again", 11
    store.insert_columns(samples(exp, rev, 12, T0, 10))
    look(store, exp, rev, T0 + 20 * MIN)
    step = kept.KeptStep(store, exp, rev, ("base", "cand"), Slo(200.0), PLAN.latencies(), lag_ms=LAG)
    late = samples(exp, rev, 13, T0 + MIN, 1, run=RUN + 44)
    real = step._tally
    sent = []

    def tally(settled, upto_ms):  # before every count, one more row recorded before the watermark
        i = len(sent)
        store.insert_columns({k: v[i : i + 1] for k, v in late.items()})
        sent.append(i)
        return real(settled, upto_ms)

    step._tally = tally
    with pytest.raises(kept.KeptStale, match="keep arriving"):
        step.read(T0 + 20 * MIN + 1000)
    # a look's count, every part's count again, and the rebuild's count: each found one more
    assert len(sent) == 3
    whole = read_step(store, exp, rev, dataclasses.replace(PLAN), Slo(200.0), keep=False)
    assert (
        whole.control.n + whole.candidate.n + whole.control.setup_errors + whole.candidate.setup_errors
        == 4000 + len(sent)
    )


def test_a_merge_between_the_parts_listing_and_the_count_is_no_rebuild(store, monkeypatch):
    # The check adds the settled parts' kept counts to a read of the others; a merge of settled
    # parts just before the read puts their rows in a part it reads too. Counted twice, every
    # part is read again before the sums are thrown away.
    exp, rev = "kept-merge", 14
    for seed in (18, 19):
        store.insert_columns(samples(exp, rev, seed, T0, 10, run=RUN + 47 + seed))
    look(store, exp, rev, T0 + 20 * MIN)
    before = state(store, exp, rev)
    listed = store.active_parts()
    assert step_parts(store, exp) <= set(before.parts) & set(listed)
    store.execute("OPTIMIZE TABLE samples FINAL")  # the step's rows now in parts of new names
    assert not step_parts(store, exp) & set(before.parts)
    monkeypatch.setattr(type(store), "active_parts", lambda self: listed)  # the listing before it
    spy = Spy(store)
    look(spy, exp, rev, T0 + 20 * MIN + 1000)
    after = state(store, exp, rev)
    assert after.generation == before.generation and after.fold == before.fold
    counts = [p for q, p in zip(spy.sql, spy.params, strict=True) if q.startswith("SELECT _part AS part")]
    assert len(counts) == 2 and counts[0]["settled"] and "settled" not in counts[1]


def test_a_fold_marks_its_start_then_writes_its_user_sums_and_index_and_its_state_last(store):
    exp, rev = "kept-order", 12
    store.insert_columns(samples(exp, rev, 14, T0, 10))
    spy = Spy(store)
    read_step(spy, exp, rev, PLAN, Slo(200.0), keep=True, now_ms=T0 + 20 * MIN, keep_lag_ms=LAG)
    inserts = [
        (q.split(" (")[0], p) for q, p in zip(spy.sql, spy.params, strict=True) if q.startswith("INSERT")
    ]
    index = f"INSERT INTO {step(store, exp, rev).index_name(state(store, exp, rev).generation)}"
    folds = f"INSERT INTO {ROLLOUT_FOLDS_TABLE}"
    assert [q for q, _p in inserts] == [folds, f"INSERT INTO {ROLLOUT_USER_SUMS_TABLE}", index, index, folds]
    assert inserts[0][1]["state"] == "" and inserts[-1][1]["state"].startswith('{"format"')
    assert inserts[0][1]["fold"] == inserts[-1][1]["fold"] == 1
    assert "emptyArrayFloat64()" in [q for q in spy.sql if q.startswith(index)][1]


def test_a_row_sent_long_before_it_was_recorded_is_counted_once_the_watermark_passes_it(store):
    # A look reads the new samples of the parts holding samples sent since an hour before the
    # watermark (kept.SENT_BEFORE_MS): a request recorded after it but sent earlier still than
    # that is found by the check once a fold passes its recorded time, and the sums built again.
    exp, rev = "kept-slow", 13
    store.insert_columns(samples(exp, rev, 15, T0, 10))
    look(store, exp, rev, T0 + 20 * MIN)
    before = state(store, exp, rev)
    slow = samples(exp, rev, 16, T0 + 19 * MIN, 0.5, run=RUN + 45)
    slow = {k: v[:3] for k, v in slow.items()}
    slow["sent_at"] = np.full(3, (T0 + 18 * MIN - kept.SENT_BEFORE_MS) // 1000 - 60, dtype=np.uint32)
    store.insert_columns(slow)
    look(store, exp, rev, T0 + 25 * MIN)  # the watermark passes them: counted
    after = state(store, exp, rev)
    assert after.generation != before.generation and after.rows == before.rows + 3


def indexes(store) -> set[str]:
    return {
        r[0]
        for r in store.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase() AND startsWith(name, %(p)s)",
            {"p": ROLLOUT_SUMS_INDEX_PREFIX},
        )
    }


def test_a_look_finds_the_kept_sums_of_its_units_by_key(store):
    # Through the generation's index: the kept user sums are read for the fold's own rows alone,
    # never scanned whole for the units the new samples touch.
    exp, rev = "kept-by-key", 14
    store.insert_columns(samples(exp, rev, 18, T0, 10))
    look(store, exp, rev, T0 + 6 * MIN)
    spy = Spy(store)
    look(spy, exp, rev, T0 + 9 * MIN)  # folds the third minute, reads what came after
    index = step(store, exp, rev).index_name(state(store, exp, rev).generation)
    increments = [q for q in spy.sql if "sumForEachIf(kv" in q]
    assert len(increments) == 2 and all(f"ALL LEFT JOIN {index} USING cluster" in q for q in increments)
    for q in spy.sql:
        if q.startswith("SELECT") and f"FROM {ROLLOUT_USER_SUMS_TABLE}" in q:
            assert "fold = %(fold)s" in q, q


@pytest.mark.parametrize("loss", ["dropped", "half-copied"])
def test_an_index_lost_or_half_copied_is_built_again(store, loss):
    # A server restarted without the index's files, another server of a cluster taking the
    # queries, a copy that stopped after its rows and before its marker: the look builds the
    # index again from the user sums before reading through it.
    exp, rev = f"kept-index-{loss}", 15
    store.insert_columns(samples(exp, rev, 19, T0, 10))
    look(store, exp, rev, T0 + 6 * MIN)
    look(store, exp, rev, T0 + 8 * MIN)
    s, st = state(store, exp, rev), step(store, exp, rev)
    assert s.fold == 2 and st._index_folds(s.generation) == {1, 2}
    if loss == "dropped":
        store.execute(f"DROP TABLE {st.index_name(s.generation)}")
        assert st._index_folds(s.generation) is None
    else:
        st._index_create(s.generation)
        st._index_add(s.generation, 1, 1)  # the second fold's rows and marker missing
        assert st._index_folds(s.generation) == {1}
    look(store, exp, rev, T0 + 8 * MIN + 1000)  # no fold: the new samples against the index
    assert st._index_folds(s.generation) == {1, 2}
    look(store, exp, rev, T0 + 20 * MIN)  # a fold through it
    after = state(store, exp, rev)
    assert after.generation == s.generation and after.fold == 3


def test_user_sums_another_spec_forgot_are_never_read_as_kept(store):
    # A look of another SLO starts sums of its own and removes the others (its index at once,
    # its user sums by a mutation the store applies in the background: here, applied, the table
    # emptied). A look of the first SLO after that finds its state but not its user sums: its
    # index cannot be built again with every row, and the sums are built anew.
    exp, rev = "kept-slo-back", 16
    store.insert_columns(samples(exp, rev, 20, T0, 10))
    other = "kept-slo-back-other"
    store.insert_columns(samples(other, rev, 21, T0, 10))
    look(store, other, rev, T0 + 20 * MIN)
    look(store, exp, rev, T0 + 20 * MIN, Slo(200.0))
    first = state(store, exp, rev, Slo(200.0))
    look(store, exp, rev, T0 + 20 * MIN, Slo(50.0))
    assert indexes(store) == {
        step(store, other, rev).index_name(state(store, other, rev).generation),
        step(store, exp, rev, Slo(50.0)).index_name(state(store, exp, rev, Slo(50.0)).generation),
    }
    store.execute(f"TRUNCATE TABLE {ROLLOUT_USER_SUMS_TABLE}")
    assert state(store, exp, rev, Slo(200.0)).generation == first.generation  # the state is still there
    store.insert_columns(samples(exp, rev, 22, T0 + 19 * MIN, 0.5, run=RUN + 47))  # after its watermark
    look(store, exp, rev, T0 + 21 * MIN, Slo(200.0))
    assert state(store, exp, rev, Slo(200.0)).generation != first.generation


def test_no_name_a_user_gives_reaches_the_index_name():
    hostile = "x'; DROP TABLE samples; --\n`\u00e9"
    st = kept.KeptStep(None, hostile, 3, ("a", "b"), SLO, ("ttft_ms",))
    assert kept._INDEX_NAME.fullmatch(st.index_name(2**63 + 5))
    assert (
        st.index_name(1) != st.index_name(2) != kept.KeptStep(None, "y", 3, ("a", "b"), SLO, ()).index_name(2)
    )


def test_a_compaction_of_user_sums_removed_meanwhile_is_not_kept(store):
    # The user sums removed after their index was built (another spec's look, racing): the index
    # still reads right, but a compaction from the record would lose units. It keeps the old
    # generation, drops its index, and the next look builds the sums anew.
    exp, rev = "kept-compact-lost", 17
    store.insert_columns(samples(exp, rev, 23, T0, 10))
    look(store, exp, rev, T0 + 6 * MIN)
    look(store, exp, rev, T0 + 8 * MIN)
    s, st = state(store, exp, rev), step(store, exp, rev)
    store.execute(f"TRUNCATE TABLE {ROLLOUT_USER_SUMS_TABLE}")  # as a removal applied since
    assert st.compact(s) is s
    assert st._index_folds(s.generation) is None
    look(store, exp, rev, T0 + 20 * MIN)
    assert state(store, exp, rev).generation != s.generation
