"""Executing one claimed shard: build its inputs from the database, run it, keep its rows.

The lowest layer of the Celery replay (tasks -> shard): it imports replay, streaming, samples,
experiments and the models, never runs or tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import time
from collections.abc import Callable

from django.conf import settings
from django.db import connections
from django.utils import timezone

from experiments.weights.process import live_router
from experiments.weights.router import UnknownExperiment
from replay.arrivals import Arrival
from replay.calibration import plan_from_json, plan_prompts, plan_to_json, wrap_streamers
from replay.plan import MIRROR, SPLIT, window_shards
from replay.runner import ShardRunner, ShardSpec, ShardStats, StopReplay
from replay.sink import BatchSink
from replay.sources import LoadedSource, load_requests
from samples.factory import sample_store, sample_writer
from streaming import loop as streaming_loop
from telemetry import tracing
from telemetry.logs import log_context
from telemetry.metrics import ReplayMeter, ShardsRunning
from workers import server_metrics
from workers.models import ReplayRun, ReplayShard
from workers.spans import traced
from workers.variants import client_for, counter_for

log = logging.getLogger(__name__)


_loaded: dict[tuple, LoadedSource] = {}  # this process's last parsed source (one entry)


def run_requests(run: ReplayRun) -> LoadedSource:
    """The run's requests as create_run counted them (the same source, seed, limit, fraction).
    A worker process keeps the last one parsed: a run's window tasks share it instead of each
    parsing the trace again (keyed by the file's size and mtime too, so a changed file is read)."""
    try:
        stat = os.stat(run.source)
        version = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        version = None  # load_requests says what is wrong with it
    key = (
        run.source,
        run.source_format,
        run.on_malformed,
        run.limit,
        run.population_seed,
        run.sample_fraction,
        version,
    )
    if version is not None and key in _loaded:
        return _loaded[key]
    loaded = load_requests(
        run.source,
        run.source_format,
        on_malformed=run.on_malformed,
        limit=run.limit,
        seed=run.population_seed,
        sample_fraction=run.sample_fraction,
        max_line_bytes=settings.TRACE_MAX_LINE_BYTES,
    )
    _loaded.clear()
    if version is not None:
        _loaded[key] = loaded
    return loaded


def run_coroutine(coro):
    """Run a coroutine to completion from a (sync) task, even inside a running loop, on the
    streaming loop (uvloop: streaming/loop.py)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return streaming_loop.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The caller's log context (run, shard, ...) goes with it.
        return pool.submit(contextvars.copy_context().run, streaming_loop.run, coro).result()


def plan_run_prompts(run: ReplayRun) -> dict:
    """The run's prompt plan (replay/calibration.py), as JSON to store on the run: each
    variant's prompt of the trace's length on its own tokenizer (/tokenize), or today's estimate,
    flagged, for a variant that cannot count. Called once, before the schedule starts."""
    variants = run.replay_variants()
    requests = run_requests(run).requests
    verify = settings.VARIANT_CA_BUNDLE or True

    async def plan():
        return await plan_prompts(
            requests,
            {v.key: (v.endpoint, v.model, v.api) for v in variants},
            counter_for(variants, verify=verify),
        )

    with log_context(experiment=run.experiment.key, run=run.pk):
        plans, report = run_coroutine(plan())
        for c in report:
            with log_context(variant=c.variant):
                log.info("run %s: prompts for %s: %s", run.pk, c.variant, c)
    return plan_to_json(plans)


def shard_rows(run: ReplayRun, offsets: list[float] | None, total: int) -> list[ReplayShard]:
    """The run's shards, one per (window, slot) with requests (replay.plan.window_shards), in
    the order their windows open; not saved."""
    return [
        ReplayShard(
            run=run, index=i, window=c.window, slot=c.slot, start_s=c.start_s, planned=len(c.positions)
        )
        for i, c in enumerate(window_shards(offsets, total, run.shard_count, run.window_s))
    ]


def shard_positions(run: ReplayRun, shard: ReplayShard, offsets: list[float] | None, total: int) -> tuple:
    """Which of the run's requests this shard sends: its (window, slot) of the one schedule."""
    for cell in window_shards(offsets, total, run.shard_count, run.window_s):
        if (cell.window, cell.slot) == (shard.window, shard.slot):
            return cell.positions
    return ()


def execute_shard(
    shard: ReplayShard,
    *,
    budget_s: float | None = None,
    handoff: Callable[[], None] | None = None,
    handoff_at_unix: float = 0.0,
) -> ShardStats:
    """Send the shard's requests (budget_s: start none after this long). ``handoff`` is called
    once, in a thread, at ``handoff_at_unix`` while the shard runs (it queues the next window
    then, so its message is free for any idle worker rather than held by one until due); the
    shard waits for it before it ends, unless the run was cancelled."""
    run = shard.run
    experiment = run.experiment
    variants = run.replay_variants()
    # 1. The shard's requests and their send offsets on the run's one schedule: its window's,
    # interleaved by position with the other slots so each carries an even share.
    loaded = run_requests(run)
    offsets_all = Arrival(**run.arrival).offsets([r.offset_s for r in loaded.requests])
    positions = shard_positions(run, shard, offsets_all, len(loaded.requests))
    requests = [loaded.requests[i] for i in positions]
    offsets = None if offsets_all is None else [offsets_all[i] for i in positions]
    # 2. What an earlier delivery of this shard already recorded (spool first, then store).
    # A first delivery has sent nothing yet, so it needs neither and starts even while the
    # store is down (its samples then go to the spool).
    writer = sample_writer()
    recorded: set[str] = set()
    if shard.attempts > 1:
        writer.flush()
        recorded = sample_store().recorded_request_ids(run.pk)
    spec = ShardSpec(
        experiment=experiment.key,
        run_id=run.pk,
        mode=run.mode,
        requests=requests,
        offsets=offsets,
        start_at_unix=run.start_at_unix,
        concurrency=run.concurrency,
        variants=[v.key for v in variants],
        attempt=shard.attempts,
        skip_ids=frozenset(recorded),
        apis={v.key: v.api for v in variants},
        render_chat=run.render_chat,
        wrap_prompt=run.wrap_prompt,
        budget_s=budget_s,
    )
    # 3. The live router: a weight change in the store takes effect mid-run.
    router = live_router() if run.mode == SPLIT else None
    if router is not None:
        doc, _revision = router.document(experiment.key)  # LookupError: never published
        if set(doc.weights) != {v.key for v in variants}:
            raise ValueError(
                f"weights document of {experiment.key!r} names {sorted(doc.weights)} but the experiment "
                f"has {sorted(v.key for v in variants)}; publish weights again (set_weights)"
            )

    def assign(user_id: str) -> tuple[str, int]:
        try:
            a = router.assign(experiment.key, user_id)
        except UnknownExperiment:
            # Its weights were retired (paused or concluded): stop sending, end cancelled.
            raise StopReplay(
                f"experiment {experiment.key!r} has no weights any more (paused or concluded): "
                "stopped sending"
            ) from None
        return a.variant, a.revision

    def revision() -> int:
        try:
            return live_router().document(experiment.key)[1]
        except LookupError:
            return 0

    def should_cancel() -> bool:
        try:
            return ReplayRun.objects.filter(pk=run.pk, cancel_requested=True).exists()
        finally:
            # These run in short-lived helper threads: never leave their connections behind.
            connections.close_all()

    def on_progress(stats: ShardStats) -> None:
        try:
            ReplayShard.objects.filter(pk=shard.pk).update(
                sent=stats.sent + stats.skipped_recorded,
                recorded=stats.recorded + stats.skipped_recorded,
                heartbeat_at=timezone.now(),
            )
        finally:
            connections.close_all()

    # abplat_replay_* as the shard goes (telemetry/metrics.py): sent, completed, lag, written.
    meter = ReplayMeter(experiment.key)

    def write(rows) -> str:
        how = writer.write(rows)
        meter.written(len(rows), "spool" if how == "spooled" else "store")
        return how

    sink = BatchSink(write)

    async def main() -> ShardStats:
        verify = settings.VARIANT_CA_BUNDLE or True  # True: the system trust store
        # A mirror run sends every request to every variant: their answers are compared (fidelity),
        # by fingerprints; by their texts too where the experiment's document allows storing them
        # (fidelity.store_answers, read as this shard starts: a change takes effect at the next).
        fingerprint = run.mode == MIRROR
        keep_text = fingerprint and experiment.fidelity_store_answers
        clients = {
            v.key: client_for(v, verify=verify, fingerprint=fingerprint, keep_text=keep_text)
            for v in variants
        }
        # Synthetic prompts of the trace's length on each variant's tokenizer, planned once per
        # run before its schedule started (plan_run_prompts): no /tokenize call on the send path.
        clients = wrap_streamers(
            clients,
            plan_from_json(run.prompt_plan, only={r.seq for r in requests}),
            run_id=run.pk,
            mode=run.mode,
        )
        clients = {key: meter.wrap_client(key, client) for key, client in clients.items()}
        try:
            ahead = run.start_at_unix + shard.start_s - time.time() if run.start_at_unix else 0.0
            log.info(
                "run %s shard %s (window %s, slot %s): %d requests, ready %.2f s %s its window opens",
                run.pk,
                shard.index,
                shard.window,
                shard.slot,
                len(requests),
                abs(ahead),
                "before" if ahead >= 0 else "AFTER",
            )
            runner = ShardRunner(
                spec,
                clients,
                assign if router else None,
                meter.put_row(traced(sink.put)),
                should_cancel=should_cancel,
                revision=revision,
                on_progress=on_progress,
            )
            handing = asyncio.create_task(hand_off()) if handoff is not None else None
            try:
                # The variants' own /metrics, scraped meanwhile by one shard per window.
                async with server_metrics.scraping(scrape_plan, run, variants):
                    stats = await runner.run()
            except BaseException:
                if handing is not None:
                    handing.cancel()
                raise
            if handing is not None:
                if stats.cancelled or stats.stop_reason:
                    handing.cancel()
                else:
                    await handing
            return stats
        finally:
            for client in clients.values():
                await client.aclose()

    async def hand_off() -> None:
        await asyncio.sleep(max(0.0, handoff_at_unix - time.time()))

        def call() -> None:
            try:
                handoff()
            except Exception:  # the other slots and a redelivery try again: log, never fail
                log.exception("run %s shard %s: queueing the next window failed", run.pk, shard.index)
            finally:
                connections.close_all()

        await asyncio.to_thread(call)

    scrape_plan = server_metrics.plan_for(shard)  # None: another shard scrapes, or it is off
    try:
        # The worker's heap frozen while the shard runs: no full collection over Django's and
        # Celery's objects in the middle of the schedule (streaming/loop.py, frozen_heap).
        with ShardsRunning(), streaming_loop.frozen_heap():
            stats = run_coroutine(main())
    finally:
        closing = time.monotonic()
        sink.close()  # raises if rows could not be written (the task fails; nothing silent)
        tracing.flush()  # the shard's request spans (ABPLAT_OTEL_ENABLED), bounded; a no-op when off
        log.debug("run %s shard %s: rows written in %.2f s", run.pk, shard.index, time.monotonic() - closing)
    log.info("run %s shard %s: %s", run.pk, shard.index, stats.summary())
    return stats
