"""The scraper parses the variants' expositions off the replay's event loop: the loop keeps
running while a parse is under way, and the rows, their order and the counts are what parsing
on the loop gave."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from analysis import server_metrics as sm
from streaming import scrape
from workers import server_metrics as wsm

EXPOSITION = {
    "fp16": '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3.0\n',
    "awq": '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 7.0\n',
    "bad": "this is { not an exposition\n",
}


class Store:
    def __init__(self):
        self.batches: list[list[dict]] = []

    def insert_server_metrics(self, rows):
        self.batches.append(list(rows))


def scraper(keys, monkeypatch) -> tuple[wsm.Scraper, Store]:
    """A scraper of the variants ``keys`` whose fetch answers EXPOSITION[key] (no network)."""
    port = {8100 + i: k for i, k in enumerate(keys)}

    async def fetch(self):
        return EXPOSITION[port[int(self.url.split(":")[2].split("/")[0])]]

    monkeypatch.setattr(scrape.MetricsFetcher, "fetch", fetch)
    run = SimpleNamespace(pk=3, experiment=SimpleNamespace(key="ttft-opt"))
    variants = [
        SimpleNamespace(key=k, endpoint=f"http://127.0.0.1:{p}/v1", auth_secret="") for p, k in port.items()
    ]
    store = Store()
    return wsm.Scraper(run, variants, 5.0, store=store), store


def scrape_once(s: wsm.Scraper) -> None:
    async def once():
        try:
            await s.scrape_all()
        finally:
            await s.aclose()

    asyncio.run(once())


def test_the_loop_runs_while_an_exposition_is_parsed(monkeypatch, settings):
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.0/8"]
    real = wsm.parse_exposition
    loop_ticked = threading.Event()
    seen: dict[str, object] = {}

    def parse(text):
        # Waits until the loop has run a callback: parsed on the loop, this would never return
        # True (the loop is held by this very call).
        seen["parser_thread"] = threading.get_ident()
        seen["loop_ran_meanwhile"] = loop_ticked.wait(timeout=10)
        return real(text)

    monkeypatch.setattr(wsm, "parse_exposition", parse)
    s, store = scraper(["fp16"], monkeypatch)

    async def main():
        seen["loop_thread"] = threading.get_ident()
        ticker = asyncio.get_running_loop().call_later(0.01, loop_ticked.set)
        try:
            await s.scrape_all()
        finally:
            ticker.cancel()
            await s.aclose()

    asyncio.run(main())
    assert seen["loop_ran_meanwhile"] is True
    assert seen["parser_thread"] != seen["loop_thread"]
    assert s.ok == 1 and s.failed == 0
    assert [r["value"] for r in store.batches[0] if r["metric"] == "vllm:num_requests_running"] == [3.0]


def test_rows_order_and_counts_are_those_of_parsing_on_the_loop(monkeypatch, settings):
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.0/8"]
    keys = ["fp16", "awq", "bad"]
    s, store = scraper(keys, monkeypatch)
    scrape_once(s)
    (rows,) = store.batches
    # what the scraper stored on the loop before: per variant in order, its parsed samples, then
    # its bookkeeping rows (up, duration); the broken exposition a failed scrape with its reason
    want = []
    for k in keys:
        try:
            samples, error = sm.parse_exposition(EXPOSITION[k]), ""
        except sm.ExpositionError as exc:
            samples, error = [], str(exc)
        want += sm.scrape_rows("ttft-opt", k, 3, 0, samples, duration_s=0.0, error=error)
    volatile = ("scraped_ms", "value")

    def strip(r):
        return {k: v for k, v in r.items() if k not in volatile or r["sample"] != sm.SCRAPE_DURATION}

    assert [{**strip(r), "scraped_ms": 0} for r in rows] == [{**strip(r), "scraped_ms": 0} for r in want]
    assert (s.ok, s.failed) == (2, 1) and set(s.errors) == {"bad"}
    assert "not Prometheus text exposition" in s.errors["bad"]
    # every variant's rows carry one time of its scrape, taken after its parse
    assert all(len({r["scraped_ms"] for r in rows if r["variant"] == k}) == 1 for k in keys)
