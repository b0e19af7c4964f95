"""Fixtures of the metrics tests: the real-worker environment of tests/workers, and scraping."""

from __future__ import annotations

import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.workers.conftest import broker_env  # noqa: F401 - the real Celery workers' environment

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Series:
    """{(sample name, sorted labels): value} of an exposition, parsed by prometheus_client."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(series: Series, name: str, **labels: str) -> float:
    """The sum of every sample called ``name`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in series.items() if n == name and want <= set(ls))


def scrape(url: str, token: str | None = None, timeout: float = 10.0) -> Series:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 200, response.status
        return parse(response.read().decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, logs=()) -> None:
    """Poll ``predicate`` (an OSError counts as "not yet": a server still starting) until it
    holds, or fail naming ``what`` with the tails of ``logs``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.3)
