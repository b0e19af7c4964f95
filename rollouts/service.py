"""The rollout controller's glue: one look at one experiment, carried out safely.

A look (``look``):

1. Lease. One decision per interval whatever the number of beat, worker or manual processes:
   the RolloutState row is claimed under a row lock until ``now + 0.9 * interval`` on the
   database's clock (``db_now``, so hosts with skewed clocks agree). With the etcd weights store
   the look also holds an etcd leader lease while it runs (``EtcdLeader``: a key bound to a
   lease, revoked after the look, expiring on etcd's clock if its holder dies). A look that
   finds either lease held does nothing and says why.
2. Read the weights store (revision and weights) and this step's samples (config revision =
   the step's). Either store down: hold, audited (never promote blind).
3. Decide (rollouts/controller.py, pure).
4. Carry it out. A weight change is announced first (``pending``, committed), then written
   with ``publish_weights(expected_revision=<the revision last seen>)``: a compare-and-set, so a
   person's change in between is never overwritten (the look yields instead). The state, the
   revision written and the audit entry commit together with the Variant rows. A controller
   killed between the store write and that commit finds its pending change in the store on the
   next look and adopts the revision (``rollout_recovered``): no double step, no false yield.
5. Notify: a JSON POST of the decision to each of the plan's webhooks, after the commit, with a
   bounded timeout, each host resolved once and checked against the egress rules
   (rollouts/webhooks.py); a failure is logged and audited, never undoes or delays the
   decision. Logs, audit entries and the look's results name webhooks redacted
   (``scheme://host:port/[redacted]``): their path or query often carries the receiver's token.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import uuid
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from analysis.definitions import slo_of
from experiments import audit
from experiments.models import Experiment, Variant
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.etcd import EtcdWeightsStore
from experiments.weights.process import weights_store
from experiments.weights.publish import publish_weights
from rollouts import controller, kept
from rollouts.controller import Decision, Plan, StoreView
from rollouts.models import RolloutState
from rollouts.readings import read_step
from rollouts.webhooks import Webhooks, post_decision
from samples.factory import sample_store
from samples.store_errors import StoreError as SampleStoreError

log = logging.getLogger(__name__)

ACTOR = "rollout-controller"
LEASE_SHARE = 0.9  # of the interval: ticks that arrive a little early still find the lease free
TERMINAL = (controller.COMPLETED, controller.ROLLED_BACK)


class RolloutError(Exception):
    """The experiment cannot be rolled out as asked (unknown, no plan)."""


@dataclasses.dataclass
class LookResult:
    experiment: str
    status: str  # the rollout state after the look
    step: int | None
    percent: int | None
    decision: Decision | None  # None: no decision this look (lease held, not running)
    note: str  # why no decision, or what was done
    revision: int
    notified: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["decision"] = self.decision.as_dict() if self.decision else None
        return json_safe(out)


def json_safe(value: Any) -> Any:
    """Infinite and NaN floats to None: JSON (and PostgreSQL's jsonb) has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def db_now() -> float:
    """Seconds since the epoch on the database server's clock."""
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())")
        else:  # SQLite: one host, its clock
            cur.execute("SELECT (julianday('now') - 2440587.5) * 86400.0")
        return float(cur.fetchone()[0])


def plan_of(experiment: Experiment) -> Plan:
    if not experiment.rollout:
        raise RolloutError(
            f"experiment {experiment.key!r} has no rollout plan (its document's rollout: block)"
        )
    control = experiment.variants.filter(control=True).values_list("key", flat=True).first()
    if control is None:
        raise RolloutError(f"experiment {experiment.key!r} has no control variant")
    return Plan.from_document(
        experiment.rollout,
        control=control,
        sla_target=experiment.sla_target,
        analysis=analysis_of(experiment),
    )


def analysis_of(experiment: Experiment) -> dict[str, bool]:
    """The experiment's analysis switches (its document's ``analysis:`` block): users as the
    independent unit and regression adjustment, each on unless the document turns it off. Read
    leniently: an experiment without the block (or the field) has both on."""
    raw: Any = getattr(experiment, "analysis", None) or {}
    if callable(raw):  # exposed as a method rather than a field
        raw = raw() or {}
    if not isinstance(raw, dict):
        raw = {}
    return {name: bool(raw.get(name, True)) for name in ("cluster_by_user", "adjust")}


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class EtcdLeader:
    """With the etcd weights store: a leader key per experiment outside the weights prefix
    (routers never list it), created only when absent and bound to an etcd lease. Held for the
    look and revoked after it; a holder that dies loses it when the lease expires on etcd's
    clock (``ttl``), so a crashed controller blocks the next ones for at most that long. The
    rate (one decision per interval) is the database lease's job (``_claim``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.prefix = store.prefix.rstrip("/") + "-rollout-leaders/"

    def acquire(self, key: str, owner: str, ttl: float) -> Any:
        """The lease when we lead, None when another controller does; StoreUnavailable when
        etcd cannot say."""
        client = self.store._client
        full = self.prefix + key
        try:
            lease = self.store._call(client.lease, max(2, int(ttl)))
            tx = client.transactions
            ok, _ = self.store._call(
                client.transaction,
                compare=[tx.version(full) == 0],
                success=[tx.put(full, owner.encode(), lease)],
                failure=[],
            )
        except Exception as exc:  # down, refused
            raise StoreUnavailable(f"{self.store.description}: rollout leader lease: {exc}") from exc
        if ok:
            return lease
        self.release(lease)
        return None

    def release(self, lease: Any) -> None:
        try:
            lease.revoke()  # deletes the leader key with it
        except Exception:  # it expires on its own
            log.debug("could not revoke a rollout leader lease", exc_info=True)


def _claim(experiment: Experiment, owner: str, interval_s: float) -> tuple[RolloutState | None, str]:
    """(the claimed state, "") or (None, why not): the database lease, on the database's clock."""
    with transaction.atomic():
        state, _ = RolloutState.objects.select_for_update().get_or_create(experiment=experiment)
        now = db_now()
        if state.lease_until_s > now:
            return None, (
                f"not due: {state.lease_owner} decided {interval_s * LEASE_SHARE - (state.lease_until_s - now):.0f} s "
                f"ago; next look after {state.lease_until_s - now:.1f} s"
            )
        state.lease_owner = owner
        state.lease_until_s = now + LEASE_SHARE * interval_s
        state.save(update_fields=["lease_owner", "lease_until_s", "updated_at"])
    return state, ""


def _locked_state(experiment: Experiment, owner: str) -> RolloutState:
    """The state row, locked, still ours (ConflictError-like RolloutError otherwise)."""
    state = RolloutState.objects.select_for_update().get(experiment=experiment)
    if state.lease_owner != owner:
        raise RolloutError(f"lost the rollout lease of {experiment.key!r} to {state.lease_owner} mid-look")
    return state


def _store_view(key: str) -> tuple[StoreView, Any]:
    try:
        got = weights_store().get(key)
    except (StoreUnavailable, WeightsError) as exc:
        return StoreView(None, None, f"{type(exc).__name__}: {exc}"[:500]), None
    if got is None:
        return StoreView({}, 0), None
    doc, revision = got
    return StoreView(dict(doc.weights), revision), doc


def _audit(experiment: Experiment, action: str, before: dict, after: dict, reason: str) -> None:
    audit.record(
        ACTOR, experiment, action, before=json_safe(before), after=json_safe(after), reason=reason[:2000]
    )


def _snapshot(state: RolloutState) -> dict[str, Any]:
    """The state an audit entry shows, with the lease of the look that wrote it: its end on the
    database clock says when that look claimed (``LEASE_SHARE`` of an interval before)."""
    return {
        "status": state.status,
        "step": state.step,
        "revision": state.last_seen_revision,
        "lease_until_s": state.lease_until_s,
    }


def _recover(experiment: Experiment, plan: Plan, state: RolloutState, view: StoreView, doc: Any, owner: str):
    """A pending change found in the store: the previous look died after writing it. Adopt it."""
    pending = state.pending or {}
    landed = (
        doc is not None
        and view.revision != state.last_seen_revision
        and doc.actor == ACTOR
        and pending.get("id", "-") in doc.reason
        and controller.weights_match(view.weights, pending["weights"])
    )
    with transaction.atomic():
        state = _locked_state(experiment, owner)
        before = _snapshot(state)
        state.pending = None
        if not landed:  # never written (or overwritten since): forget it and decide afresh
            state.save(update_fields=["pending", "updated_at"])
            return None
        state.step = pending["to_step"]
        state.status = pending["state_after"]
        state.step_started_s = db_now()
        state.last_seen_revision = view.revision
        state.srm_max_log_e = 0.0
        state.save()
        for v in Variant.objects.filter(experiment=experiment):
            w = pending["weights"].get(v.key, 0)
            if v.weight != w:
                v.weight = w
                v.save(update_fields=["weight"])
        reason = (
            f"the previous look wrote revision {view.revision} ({pending['action']} to "
            f"{pending['weights']}) and stopped before recording it: adopted, no second step"
        )
        _audit(experiment, "rollout_recovered", before, {**_snapshot(state), "pending": pending}, reason)
    return reason


def look(key: str, *, interval_s: float, notify: bool = True, webhooks: Webhooks | None = None) -> LookResult:
    """One look at ``key``'s rollout (module docstring). Never raises for a store that is down.
    ``webhooks``: how the decision is POSTed (Webhooks(): the settings' resolver, system CAs)."""
    experiment = Experiment.objects.filter(key=key).first()
    if experiment is None:
        raise RolloutError(f"unknown experiment {key!r}")
    plan = plan_of(experiment)
    state = RolloutState.objects.filter(experiment=experiment).first()

    def result(decision: Decision | None, note: str, st: RolloutState | None, sent=()) -> LookResult:
        step = st.step if st is not None else None
        pct = plan.steps[step] if step is not None else None
        if st is not None and st.status == controller.ROLLED_BACK:
            pct = 0
        rev = st.last_seen_revision if st is not None else 0
        status = st.status if st is not None else "not started"
        return LookResult(key, status, step, pct, decision, note, rev, list(sent))

    if experiment.status != Experiment.Status.RUNNING:
        return result(None, f"experiment is {experiment.status}: the controller acts on running ones", state)
    if state is not None and state.status != controller.RUNNING:
        return result(None, f"rollout is {state.status}: nothing to decide", state)
    owner = _owner()
    store = weights_store()
    leader = EtcdLeader(store) if isinstance(store, EtcdWeightsStore) else None
    lease = None
    if leader is not None:
        try:
            lease = leader.acquire(key, owner, max(LEASE_SHARE * interval_s, 2.0))
        except StoreUnavailable as exc:
            lease = "unavailable"  # the look goes on: it reads the store, finds it down, holds
            log.warning("rollout %s: %s", key, exc)
        if lease is None:
            st = RolloutState.objects.filter(experiment=experiment).first()
            return result(
                None, "not due: another controller is deciding (it holds the etcd leader lease)", st
            )
    try:
        return _look(experiment, plan, owner, interval_s, notify, result, webhooks or Webhooks())
    finally:
        if leader is not None and lease not in (None, "unavailable"):
            leader.release(lease)


def _look(
    experiment: Experiment,
    plan: Plan,
    owner: str,
    interval_s: float,
    notify: bool,
    result,
    webhooks: Webhooks,
) -> LookResult:
    key = experiment.key
    state, why = _claim(experiment, owner, interval_s)
    if state is None:
        return result(None, why, RolloutState.objects.filter(experiment=experiment).first())
    view, doc = _store_view(key)
    # A pending change and the store down: keep it for a look that can tell whether it landed
    # (this one holds: the store is down).
    if state.pending and view.revision is not None:
        recovered = _recover(experiment, plan, state, view, doc, owner)
        state.refresh_from_db()
        if recovered:
            return result(None, recovered, state)
    reading = None
    if state.step is not None and view.revision is not None:
        reading = read_step(
            sample_store(),
            key,
            state.last_seen_revision,
            plan,
            slo_of(experiment),
            keep=settings.ROLLOUT_KEPT_SUMS,
            keep_lag_ms=settings.ROLLOUT_KEPT_LAG_S * 1000,
        )
    decision = controller.decide_step(plan, state.as_state(), view, reading, db_now())
    note = _carry_out(experiment, plan, decision, owner, view)
    state.refresh_from_db()
    if state.status in (controller.COMPLETED, controller.ROLLED_BACK):
        _forget_kept_sums(key)
    sent = _notify(experiment, plan, decision, state, webhooks) if notify and plan.notify else []
    return result(decision, note, state, sent)


def _forget_kept_sums(key: str) -> None:
    """A finished rollout's kept sums removed (rollouts.kept.forget: their index holds the
    sample store's memory). The decision stands when the store cannot: logged, and the sums
    go when the experiment's next rollout starts sums of its own."""
    try:
        kept.forget(sample_store(), key)
    except SampleStoreError as exc:
        log.warning("rollout %s: its kept sums were not removed: %s", key, exc)


def _carry_out(experiment: Experiment, plan: Plan, d: Decision, owner: str, view: StoreView) -> str:
    payload = json_safe(d.as_dict())
    if d.weights is None:
        with transaction.atomic():
            state = _locked_state(experiment, owner)
            before = _snapshot(state)
            state.status = d.state_after
            state.srm_max_log_e = d.srm_log_e
            state.last_decision = payload
            state.decisions += 1
            state.save()
            _audit(
                experiment, f"rollout_{d.action}", before, {**_snapshot(state), "decision": payload}, d.reason
            )
        return d.reason
    # A weight change: announce it, then compare-and-set the store.
    decision_id = uuid.uuid4().hex[:16]
    with transaction.atomic():
        state = _locked_state(experiment, owner)
        # The controller's base: the store's revision before the first step, the revision it
        # last wrote after that (rollouts/controller.py, Decision.base_revision).
        expected = d.base_revision if d.base_revision is not None else state.last_seen_revision
        state.pending = {
            "id": decision_id,
            "action": d.action,
            "to_step": d.to_step,
            "weights": d.weights,
            "state_after": d.state_after,
            "expected_revision": expected,
        }
        state.save(update_fields=["pending", "updated_at"])
    reason = f"rollout {d.action}: {d.reason} [decision {decision_id}]"
    try:
        with transaction.atomic():
            _, revision = publish_weights(
                experiment.key, d.weights, ACTOR, reason, expected_revision=expected
            )
            state = _locked_state(experiment, owner)
            before = _snapshot(state)
            state.pending = None
            state.status = d.state_after
            state.step = d.to_step if d.to_step is not None else state.step
            state.step_started_s = db_now()
            state.last_seen_revision = revision
            state.srm_max_log_e = 0.0
            state.last_decision = payload
            state.decisions += 1
            state.save()
            _audit(
                experiment,
                f"rollout_{d.action}",
                before,
                {**_snapshot(state), "weights": d.weights, "decision": payload},
                d.reason,
            )
        return f"{d.reason} (weights revision {revision})"
    except ConflictError as exc:
        # Someone wrote between our read and our write: theirs stands.
        return _yield_after_conflict(experiment, d, owner, exc)
    except (StoreUnavailable, WeightsError) as exc:
        with transaction.atomic():
            state = _locked_state(experiment, owner)
            before = _snapshot(state)
            state.pending = None
            state.save(update_fields=["pending", "updated_at"])
            why = f"{d.action} not carried out: weights store refused ({type(exc).__name__}: {exc}); holding"
            _audit(experiment, "rollout_hold", before, {**_snapshot(state), "decision": payload}, why)
        return why


def _yield_after_conflict(experiment: Experiment, d: Decision, owner: str, exc: ConflictError) -> str:
    why = (
        f"{d.action} not carried out: the weights changed under the controller ({exc}); "
        "a person is in charge: the rollout yields"
    )
    with transaction.atomic():
        state = _locked_state(experiment, owner)
        before = _snapshot(state)
        state.pending = None
        state.status = controller.YIELDED if state.step is not None else state.status
        state.save()
        _audit(
            experiment, "rollout_yield", before, {**_snapshot(state), "decision": json_safe(d.as_dict())}, why
        )
    return why


def _notify(
    experiment: Experiment, plan: Plan, d: Decision, state: RolloutState, webhooks: Webhooks
) -> list[dict[str, Any]]:
    """POST the decision to the plan's webhooks (rollouts/webhooks.py); log and audit those
    that failed. The results, the log and the audit entry name each webhook redacted."""
    message = json_safe(
        {
            "experiment": experiment.key,
            "action": d.action,
            "reason": d.reason,
            "state": state.status,
            "step": state.step,
            "percent": 0
            if state.status == controller.ROLLED_BACK
            else (plan.steps[state.step] if state.step is not None else None),
            "weights": d.weights,
            "revision": state.last_seen_revision,
            "numbers": d.numbers,
        }
    )
    results = post_decision(plan.notify, message, webhooks)
    failed = [r for r in results if "error" in r]
    for r in failed:
        log.warning("rollout %s: webhook %s failed: %s", experiment.key, r["url"], r["error"])
    if failed:
        try:
            _audit(
                experiment,
                "rollout_notify_failed",
                {"action": d.action},
                {"webhooks": failed},
                f"{len(failed)} of {len(results)} webhooks failed for the {d.action} decision",
            )
        except Exception:
            log.exception("rollout %s: could not audit the failed webhooks", experiment.key)
    return results


def running_rollouts() -> list[str]:
    """Keys of running experiments with a plan whose rollout is not finished or stopped."""
    keys = Experiment.objects.filter(status=Experiment.Status.RUNNING, rollout__isnull=False).values_list(
        "key", flat=True
    )
    stopped = set(
        RolloutState.objects.exclude(status=controller.RUNNING).values_list("experiment__key", flat=True)
    )
    return sorted(k for k in keys if k not in stopped)
