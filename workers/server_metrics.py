"""Scraping the variants' own /metrics during a replay, into the sample store.

One scraper per (run, variant) at any moment, whatever the shards: of each window's shards, the
one with the lowest slot scrapes (``scrapes_for``), at the points of one grid shared by the whole
run (time zero + n * ABPLAT_SERVER_METRICS_INTERVAL_S) that fall inside its window; the last
window's scraper goes on until its shard ends. Two more scrapes bracket the run
(``scrape_now``): the baseline, taken by workers.tasks.start_replay before it fixes time zero
(so before any request is sent: the run's first increases are measured from it), and the last,
taken by workers.tasks.finish_replay once every shard has ended. So successive windows' scrapers
never scrape at once, their series join without a gap (increases are taken between consecutive
scrapes at read time: analysis.server_metrics), and eager Celery (one shard, one window) is the
same rule.

The fetch runs on the shard's event loop (it waits on the network); parsing the exposition and
building its rows (tens of ms of CPU for a few engines' series, at every grid point) run in the
scraper's own worker thread, so they never hold the loop that sends the replay's requests on
schedule. One thread for all the variants: the parses of one scrape queue behind each other
rather than several threads contending with the loop for the interpreter.

A scrape that fails (refused, timed out, too large, not an exposition) never fails the replay:
it is stored as a failed scrape (abplat:scrape_up 0, with its reason), counted and logged. Rows
the store cannot take now wait in memory for the next scrape's write (at most
MAX_PENDING_ROWS; past that the oldest are dropped and counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from django.conf import settings

from analysis.server_metrics import ExpositionError, parse_exposition, scrape_rows
from samples.factory import sample_store
from samples.store import StoreError
from streaming.scrape import SCRAPE_TIMEOUT_S, MetricsFetcher, ScrapeError
from workers.models import ReplayRun, ReplayShard
from workers.variants import allowlist, ca_verify, variant_headers

log = logging.getLogger(__name__)

MAX_PENDING_ROWS = 50_000


def interval_s() -> int:
    """ABPLAT_SERVER_METRICS_INTERVAL_S (0: scraping is off)."""
    return int(getattr(settings, "SERVER_METRICS_INTERVAL_S", 0))


class Scraper:
    """Scrapes every variant of a run together, writes the rows, keeps count."""

    def __init__(self, run: ReplayRun, variants: Sequence[Any], every_s: float, store: Any = None) -> None:
        self.run, self.every_s = run, every_s
        self.experiment_key = run.experiment.key  # read here, never by the parser thread
        self.store = store if store is not None else sample_store()
        # A scrape must end before the next grid point (never two scrapes of a variant at once).
        self.timeout_s = min(SCRAPE_TIMEOUT_S, 0.8 * every_s) if every_s > 0 else SCRAPE_TIMEOUT_S
        self.fetchers: dict[str, MetricsFetcher | str] = {}
        verify, allow = ca_verify(), allowlist()
        for v in variants:
            try:
                headers = variant_headers(v)
                self.fetchers[v.key] = MetricsFetcher(
                    v.endpoint, allow=allow, verify=verify, headers=headers, timeout_s=self.timeout_s
                )
            except ValueError as exc:  # SecretError, a bad endpoint or CA bundle: every scrape fails so
                self.fetchers[v.key] = str(exc)
        self.ok = self.failed = self.write_failures = self.dropped_rows = 0
        self.errors: dict[str, str] = {}  # variant -> its last scrape error
        self._pending: list[dict[str, Any]] = []
        # Where expositions are parsed into rows: off the event loop (module docstring).
        self._parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="abplat-scrape-parse")

    def _rows(
        self, key: str, text: str | None, error: str, started: float
    ) -> tuple[list[dict[str, Any]], str]:
        """The rows of one scrape and its error ("" when none), from the fetched ``text`` (None
        when the fetch failed with ``error``). CPU-bound: runs in the parser thread."""
        samples: list[tuple[str, str, str, str, float]] = []
        if text is not None:
            try:
                samples = parse_exposition(text)
            except ExpositionError as exc:
                error = str(exc)
        scraped_ms = int(time.time() * 1000)
        rows = scrape_rows(
            self.experiment_key,
            key,
            self.run.pk,
            scraped_ms,
            samples,
            duration_s=time.perf_counter() - started,
            error=error,
        )
        return rows, error

    async def scrape_variant(self, key: str) -> list[dict[str, Any]]:
        fetcher = self.fetchers[key]
        started = time.perf_counter()
        error, text = "", None
        if isinstance(fetcher, str):
            error = fetcher
        else:
            try:
                text = await fetcher.fetch()
            except ScrapeError as exc:
                error = str(exc)
        loop = asyncio.get_running_loop()
        rows, error = await loop.run_in_executor(self._parser, self._rows, key, text, error, started)
        if error:
            self.failed += 1
            if self.errors.get(key) != error:
                log.warning("run %s: scraping %s's metrics failed: %s", self.run.pk, key, error)
            self.errors[key] = error
        else:
            self.ok += 1
            self.errors.pop(key, None)
        return rows

    async def scrape_all(self) -> None:
        """One scrape of every variant (concurrently), then one write of the rows."""
        batches = await asyncio.gather(*(self.scrape_variant(k) for k in self.fetchers))
        self._pending.extend(row for rows in batches for row in rows)
        await self.flush()

    async def flush(self) -> None:
        """Write what waits; on a store error keep it for the next try (bounded)."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        try:
            await asyncio.to_thread(self.store.insert_server_metrics, rows)
        except (StoreError, ValueError) as exc:
            self.write_failures += 1
            log.warning(
                "run %s: server metrics not stored (%d rows kept for the next try): %s",
                self.run.pk,
                len(rows),
                exc,
            )
            self._pending = rows + self._pending
            if len(self._pending) > MAX_PENDING_ROWS:
                drop = len(self._pending) - MAX_PENDING_ROWS
                self.dropped_rows += drop
                del self._pending[:drop]

    async def run_grid(self, origin: float, lo: float, hi: float) -> None:
        """Scrape at origin + n * every_s for every such point in [lo, hi) still ahead, until
        cancelled or past ``hi``."""
        last = -1
        while True:
            # the next point ahead: one missed while scraping (a slow store) is skipped
            n = max(last + 1, math.ceil((max(lo, time.time()) - origin) / self.every_s))
            at = origin + n * self.every_s
            if at >= hi:
                return
            await asyncio.sleep(max(0.0, at - time.time()))
            await self.scrape_all()
            last = n

    def summary(self) -> str:
        text = f"server metrics: {self.ok} scrapes, {self.failed} failed"
        if self.write_failures:
            text += f", {self.write_failures} writes failed ({self.dropped_rows} rows dropped)"
        return text

    async def aclose(self) -> None:
        for f in self.fetchers.values():
            if not isinstance(f, str):
                await f.aclose()
        # Not waiting: a parse still running (its scrape was cancelled) ends on its own, off the loop.
        self._parser.shutdown(wait=False)


def scrapes_for(shard: ReplayShard) -> bool:
    """Whether this shard's task scrapes: scraping is on and it has the lowest slot of its window."""
    if interval_s() <= 0:
        return False
    lowest = (
        ReplayShard.objects.filter(run_id=shard.run_id, window=shard.window)
        .order_by("slot")
        .values_list("slot", flat=True)
        .first()
    )
    return lowest == shard.slot


def grid_bounds(shard: ReplayShard) -> tuple[float, float, float]:
    """(origin, lo, hi) of a scraping shard's grid: its window, open-ended for the run's last
    window (and for a run without windows)."""
    run = shard.run
    origin = float(run.start_at_unix or time.time())
    lo = origin + shard.start_s
    later = ReplayShard.objects.filter(run_id=run.pk, window__gt=shard.window).exists()
    hi = lo + run.window_s if (run.window_s and later) else math.inf
    return origin, lo, hi


def plan_for(shard: ReplayShard) -> tuple[float, float, float] | None:
    """The scraping grid of a shard's task (grid_bounds), or None when it does not scrape. Sync
    (database queries): called before the shard's event loop starts."""
    return grid_bounds(shard) if scrapes_for(shard) else None


@contextlib.asynccontextmanager
async def scraping(
    plan: tuple[float, float, float] | None, run: ReplayRun, variants: Sequence[Any]
) -> AsyncIterator[Scraper | None]:
    """Scrape on ``plan`` (plan_for) while the body runs; then write what waits and log the
    counts. A failure in here is logged, never raised into the shard."""
    scraper = None
    if plan is not None:
        try:
            scraper = Scraper(run, variants, interval_s())
        except Exception:  # e.g. an allowlist setting the variants' clients refuse as well
            log.exception("run %s: the metrics scraper could not start; the shard goes on without it", run.pk)
    if scraper is None:
        yield None
        return
    task = asyncio.create_task(scraper.run_grid(*plan))
    try:
        yield scraper
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("run %s: scraping the variants' metrics stopped early", run.pk)
        try:
            await scraper.flush()
            await scraper.aclose()
        except Exception:
            log.exception("run %s: closing the metrics scraper failed", run.pk)
        log.info("run %s: %s", run.pk, scraper.summary())


def scrape_now(run_id: int, what: str) -> None:
    """One scrape of every variant of a run, now: ``what`` is "baseline" (before time zero) or
    "final" (every shard ended): the ends of the span the run's increases cover. Never raises:
    a failure is stored as a failed scrape, or logged."""
    every = interval_s()
    if every <= 0:
        return
    try:
        run = ReplayRun.objects.select_related("experiment").get(pk=run_id)
        variants = run.replay_variants()
        scraper = Scraper(run, variants, every)

        async def once() -> None:
            try:
                await scraper.scrape_all()
            finally:
                await scraper.aclose()

        # In a thread of its own: the caller may be inside an event loop (eager Celery).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, once()).result()
        log.info("run %s: %s scrape: %s", run_id, what, scraper.summary())
    except Exception:  # the run goes on whatever happens here
        log.exception("run %s: the %s scrape of the variants' metrics failed", run_id, what)
