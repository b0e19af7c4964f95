"""A mirror run's scoring pass: teacher-forced KL of a share of its requests, after it ended.

When a mirror run of an experiment whose document sets ``fidelity.score_share`` > 0 ends (the
replay_finished signal: every shard has stopped sending, so the pass never competes with the
run's latency sampling), ``queue_scoring`` queues ``score_run``. The task:

1. re-reads the run and its experiment and returns quietly when there is nothing to score (the
   run is gone, not a mirror run, the share is 0, the control was not replayed), and puts itself
   off while another replay sends to the same servers (``sending_to``): the pass's calls would
   be load in that run's latency;
2. picks the requests: of the seqs the control recorded in the run, those fidelity.scores.chosen
   takes under the share (the same ones every time), ``CHUNK`` of them per task, the rest in a
   task it queues next (so a large run never meets the Celery time limit);
3. rebuilds each picked request's prompt as the replay sent it to the control (the source's
   text, or the synthetic prompt of the run's prompt plan, shaped for the control's API by
   replay.shapes: workers.shard's run_requests and the run's stored plan);
4. asks the control for its greedy answer as token ids (the control's API: a chat request goes
   to the chat API, which applies the model's chat template and returns the templated prompt's
   ids), then scores those prompt ids + answer ids under the control and every other variant
   through their completions API (fidelity.scoring), at most settings.FIDELITY_SCORE_CONCURRENCY
   calls in flight, each on the variant's small-call client (streaming.transports.egress_client:
   the egress allowlist, the CA rule, the variant's secret, a fixed timeout);
5. writes one row per (request, variant) with store.insert_fidelity_scores (fidelity.scores
   builds them: a score, or why not). The table replaces a request's rows on its key, so a task
   run again (a redelivered message, a pass started by hand) replaces what it wrote.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import httpx
from celery import shared_task
from django.conf import settings

from fidelity import scores
from fidelity.scoring import (
    Answer,
    answer_request,
    chat_answer_request,
    parse_answer,
    parse_scoring,
    scoring_request,
)
from replay import shapes
from replay.calibration import plan_from_json
from replay.plan import MIRROR
from replay.prompts import synth_prompt
from samples.factory import sample_store
from samples.schema import SAMPLES_TABLE
from samples.store import StoreUnavailable
from streaming.client import APIS
from streaming.egress import EgressRefused
from streaming.endpoint import Endpoint
from streaming.transports import egress_client, error_text
from telemetry.logs import context_from_args
from workers.models import ReplayRun
from workers.shard import run_coroutine, run_requests
from workers.variants import allowlist, ca_verify, variant_headers

log = logging.getLogger(__name__)

CHUNK = 200  # requests per task: a few minutes of calls at most, well inside the time limit
CALL_TIMEOUT_S = 300.0  # one answer or scoring call (a long prompt scored on a busy server)
# The answer is asked as the replay asked it: greedy, and to its full max_tokens (the replay's
# ShardSpec.ignore_eos), so the answer scored is the one the mirror run compared.
ANSWER_EXTRA = {"ignore_eos": True}
# While another replay sends to the same servers the pass waits, WAIT_S at a time, up to a day.
WAIT_S = 60
MAX_WAITS = 24 * 60


class _Job(NamedTuple):
    key: scores.Request
    prompt: Any  # as the replay sent it to the control (a text or a message list)
    max_tokens: int
    missing: str = ""  # why there is no prompt to send (the source changed or is gone)


def queue_scoring(sender: Any, *, run_id: int, experiment: str, **kwargs: Any) -> None:
    """replay_finished's receiver (workers.apps): queue the pass when the run is a mirror run of
    an experiment that scores a share of its requests."""
    run = ReplayRun.objects.select_related("experiment").filter(pk=run_id).first()
    if run is not None and run.mode == MIRROR and run.experiment.fidelity_score_share > 0:
        score_run.delay(run_id)


def sending_to(run: ReplayRun, variants: Sequence[Any]) -> int | None:
    """The id of another replay run queued or sending to one of these variants' endpoints (its
    latency would be measured beside the pass's calls), or None."""
    endpoints = {v.endpoint for v in variants}
    others = ReplayRun.objects.filter(status__in=(ReplayRun.Status.QUEUED, ReplayRun.Status.RUNNING)).exclude(
        pk=run.pk
    )
    for other in others.select_related("experiment"):
        if endpoints & {v.endpoint for v in other.replay_variants()}:
            return other.pk
    return None


@shared_task(
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(StoreUnavailable,),
    retry_backoff=5,
    retry_jitter=True,
    max_retries=5,
)
@context_from_args(run="run_id")
def score_run(self, run_id: int, start: int = 0, waited: int = 0) -> int:
    """Score the run's picked requests from the ``start``-th on (module docstring); returns the
    rows written by this task. ``waited``: how often it was put off for another run's
    measurements (WAIT_S apart, at most MAX_WAITS, then it scores regardless, saying so)."""
    run = ReplayRun.objects.select_related("experiment").filter(pk=run_id).first()
    if run is None or run.mode != MIRROR or run.experiment.fidelity_score_share <= 0:
        return 0
    variants = run.replay_variants()
    # 1b. Off every latency path the platform measures: another replay sending to these servers
    # now (the next step of a capacity search, another experiment's run) would measure the
    # pass's calls as load, so the pass waits for it. (Eager Celery has no broker to wait
    # through: it scores at once.)
    busy = sending_to(run, variants)
    if busy is not None and not self.request.is_eager:
        if waited < MAX_WAITS:
            score_run.apply_async((run_id, start, waited + 1), countdown=WAIT_S)
            return 0
        log.warning("run %s: scoring beside run %s, still sending after %d waits", run_id, busy, waited)
    rows, picked = score_chunk(run, start)
    if start + CHUNK < picked:
        score_run.delay(run_id, start + CHUNK, waited)
    return rows


def score_chunk(run: ReplayRun, start: int) -> tuple[int, int]:
    """Score the picked requests ``start`` to ``start + CHUNK`` of a run (module docstring, 2-5);
    (rows written, requests picked in the whole run). No check that another run is sending:
    score_run's, or the caller's (``manage.py score_fidelity``)."""
    experiment = run.experiment
    share, top_k = float(experiment.fidelity_score_share), int(experiment.fidelity_score_top_k)
    variants = run.replay_variants()
    control = experiment.control_key()
    if run.mode != MIRROR or share <= 0 or control not in {v.key for v in variants}:
        return 0, 0
    # 2. The picked requests, in seq order; this chunk of them.
    store = sample_store()
    recorded = [
        int(seq)
        for (seq,) in store.query(
            f"SELECT DISTINCT seq FROM {SAMPLES_TABLE} WHERE run_id = %(run)s AND experiment = %(e)s "
            "AND variant = %(c)s",
            {"run": run.pk, "e": experiment.key, "c": control},
        )
    ]
    picked = scores.choose(run.pk, recorded, share)
    batch = picked[start : start + CHUNK]
    if not batch:
        return 0, len(picked)
    # 3. Each one's prompt as the run sent it to the control.
    try:
        by_seq = {r.seq: r for r in run_requests(run).requests}
        missing = "the request is no longer in the run's source (changed since the run)"
    except (OSError, ValueError) as exc:  # replay.sources.SourceError is a ValueError
        by_seq, missing = {}, f"the run's source cannot be read: {error_text(exc)}"
    control_variant = next(v for v in variants if v.key == control)
    plan = plan_from_json(run.prompt_plan, only=set(batch)).get(control, {})
    jobs = []
    for seq in batch:
        req = by_seq.get(seq)
        key = scores.Request(
            experiment=experiment.key,
            run_id=run.pk,
            seq=seq,
            user_id=req.user_id if req is not None else "",
            control=control,
            top_k=top_k,
        )
        if req is None:
            jobs.append(_Job(key, None, 0, missing))
        else:
            jobs.append(_Job(key, _sent_prompt(run, req, plan, control_variant.api), req.max_tokens))
    # 4 and 5. The control's answers scored everywhere; the rows written.
    rows = run_coroutine(_score_all(jobs, variants, int(settings.FIDELITY_SCORE_CONCURRENCY)))
    store.insert_fidelity_scores(rows)
    log.info(
        "run %s: scored %d requests (%d to %d of %d picked), %d rows",
        run.pk,
        len(batch),
        start,
        start + len(batch) - 1,
        len(picked),
        len(rows),
    )
    return len(rows), len(picked)


def _sent_prompt(run: ReplayRun, req, plan: Mapping[int, Any], api: str) -> Any:
    """What the replay sent the control for ``req`` (replay.runner's prompt, then the
    calibrated text of the run's plan for a synthetic request: replay.calibration)."""
    text = None
    if req.messages is None and req.prompt is None:
        sent = plan.get(req.seq)
        text = sent.text if sent is not None else synth_prompt(req.seq, req.prompt_tokens)[0]
    return shapes.payload(req, text, api, render_chat=run.render_chat, wrap_prompt=run.wrap_prompt)


class _Caller:
    """The variants' small-call clients and the bound on calls in flight."""

    def __init__(self, variants: Sequence[Any], concurrency: int) -> None:
        self.slots = asyncio.Semaphore(concurrency)
        verify, allow = ca_verify(), allowlist()
        self.variants = {v.key: v for v in variants}
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.refused: dict[str, str] = {}
        for v in variants:
            try:
                headers = {**variant_headers(v), "accept": "application/json"}
            except ValueError as exc:  # SecretError: names the secret, never its value
                self.refused[v.key] = str(exc)
                continue
            self.clients[v.key] = egress_client(
                allow=allow, verify=verify, timeout_s=CALL_TIMEOUT_S, headers=headers
            )

    async def post(self, variant: str, api: str, body: Mapping[str, Any]) -> tuple[int, str]:
        """(HTTP status, body text); raises httpx.HTTPError, EgressRefused or ValueError (a
        variant whose secret cannot be sent)."""
        if variant in self.refused:
            raise ValueError(self.refused[variant])
        v = self.variants[variant]
        url = Endpoint.parse(v.endpoint).root + APIS[api]
        async with self.slots:
            resp = await self.clients[variant].post(url, json=dict(body))
        return resp.status_code, resp.text

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


async def _answer(caller: _Caller, control: Any, prompt: Any, max_tokens: int) -> Answer | str:
    """The control's greedy answer, or why there is none."""
    if control.api == shapes.CHAT:
        body = chat_answer_request(control.model, prompt, max_tokens, ANSWER_EXTRA)
    else:
        body = answer_request(control.model, prompt, max_tokens, ANSWER_EXTRA)
    try:
        status, text = await caller.post(control.key, control.api, body)
    except (httpx.HTTPError, EgressRefused, ValueError) as exc:
        return f"the control's answer: {error_text(exc)}"
    if status != 200:
        return f"the control's answer: HTTP {status}: {' '.join(text.split())[:300]}"
    try:
        return parse_answer(json.loads(text))
    except ValueError as exc:  # json.JSONDecodeError included
        return f"the control's answer: {exc}"


async def _scoring(caller: _Caller, variant: Any, prompt_ids, answer_ids, top_k: int) -> scores.Scoring:
    body = scoring_request(variant.model, prompt_ids, answer_ids, top_k)
    try:
        status, text = await caller.post(variant.key, shapes.COMPLETIONS, body)
    except (httpx.HTTPError, EgressRefused, ValueError) as exc:
        return scores.Scoring(None, scores.HTTP_ERROR, error_text(exc))
    if status != 200:
        return scores.Scoring(None, *scores.refusal(status, text))
    try:
        return scores.Scoring(parse_scoring(json.loads(text), prompt_ids, answer_ids, top_k))
    except ValueError as exc:
        return scores.Scoring(None, *scores.unreadable(exc))


async def _score_one(caller: _Caller, job: _Job, variants: Sequence[Any]) -> list[dict[str, Any]]:
    """The rows of one picked request: the control's answer, then its scoring everywhere."""
    key, keys = job.key, [v.key for v in variants]
    control = next(v for v in variants if v.key == key.control)
    if job.missing:
        return scores.failed_rows(key, keys, scores.CONTROL_ERROR, job.missing)
    answer = await _answer(caller, control, job.prompt, job.max_tokens)
    if isinstance(answer, str):
        return scores.failed_rows(key, keys, scores.CONTROL_ERROR, answer)
    if not answer.answer_ids:
        return scores.failed_rows(key, keys, scores.EMPTY_ANSWER, "the control answered no token")
    if not answer.prompt_ids:
        return scores.failed_rows(key, keys, scores.CONTROL_ERROR, "the control's prompt has no token ids")
    got = await asyncio.gather(
        *(_scoring(caller, v, answer.prompt_ids, answer.answer_ids, key.top_k) for v in variants)
    )
    return scores.compared_rows(key, dict(zip(keys, got, strict=True)))


async def _score_all(
    jobs: Sequence[_Job],
    variants: Sequence[Any],
    concurrency: int,
) -> list[dict[str, Any]]:
    caller = _Caller(variants, concurrency)
    try:
        done = await asyncio.gather(*(_score_one(caller, job, variants) for job in jobs))
    finally:
        await caller.aclose()
    return [row for rows in done for row in rows]
