"""The report cache and the request-rate counters on Redis (ABPLAT_CACHE_URL, abplat/caches.py):
shared by separate processes, kept apart by their key prefixes, and a Redis that is down or
hangs costs a report its cache, never the report, and the rates fall back to each process's
own count."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

import pytest
import redis
from django.test import override_settings

from abplat import api
from abplat.caches import REPORT_PREFIX, THROTTLE_PREFIX, cache_settings, check_cache_url
from analysis import definitions as q
from dashboards import reports
from samples import synthetic
from tests.workers.background import manage

pytestmark = [pytest.mark.django_db, pytest.mark.services]

REDIS_URL = os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def redis_url():
    """The test Redis database, emptied; a failed test (never a skip) when Redis is not there."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()
    except redis.RedisError as exc:
        pytest.fail(
            f"Redis not reachable at {REDIS_URL} (ABPLAT_TEST_REDIS_URL): {exc}; start it "
            "(scripts/services.sh start) or point ABPLAT_TEST_REDIS_URL at one",
            pytrace=False,
        )
    yield REDIS_URL
    redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()


@pytest.fixture(autouse=True)
def _no_rate_fallback():
    """The per-process fallback counts start empty and the shared cache is tried at once."""
    api._local_rates.clear()
    api._shared_down_until = 0.0
    yield
    api._local_rates.clear()
    api._shared_down_until = 0.0


def _process_env(tmp_path, url: str, **extra: str) -> dict[str, str]:
    """Another process of the platform: its own ABPLAT_VAR, the same Redis cache."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_") or k == "ABPLAT_ENV_FILE"}
    return {**base, "ABPLAT_VAR": str(tmp_path / "other"), "ABPLAT_CACHE_URL": url, **extra}


def _loaded(store) -> None:
    spec = synthetic.SyntheticSpec(
        run_id=41,
        n=2000,
        seed=3,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=600.0,
    )
    synthetic.insert(store, synthetic.generate(spec))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_a_url_both_caches_are_per_process_memory():
    caches = cache_settings("")
    assert {c["BACKEND"] for c in caches.values()} == {"django.core.cache.backends.locmem.LocMemCache"}
    assert caches["default"]["LOCATION"] != caches["throttle"]["LOCATION"]


def test_with_a_url_both_caches_are_that_redis_under_their_own_prefixes():
    caches = cache_settings("rediss://cache.internal:6380/2")
    for alias, prefix in (("default", REPORT_PREFIX), ("throttle", THROTTLE_PREFIX)):
        assert caches[alias]["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
        assert caches[alias]["LOCATION"] == "rediss://cache.internal:6380/2"
        assert caches[alias]["KEY_PREFIX"] == prefix
        assert caches[alias]["OPTIONS"]["socket_connect_timeout"] > 0
        assert caches[alias]["OPTIONS"]["socket_timeout"] > 0


@pytest.mark.parametrize(
    "cache, broker, error",
    [
        ("redis://h:6379/x", "", "the path must be a Redis database number"),
        ("redis://h:6379", "redis://h:6379/0", "name the same Redis database (h:6379/0)"),
        ("redis://h:6379/1", "redis://h/?db=1", "name the same Redis database (h:6379/1)"),
    ],
)
def test_a_cache_url_that_cannot_work_is_refused(cache, broker, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        check_cache_url(cache, broker)


@pytest.mark.parametrize(
    "cache, broker", [("redis://h:6379/1", "redis://h:6379/0"), ("redis://h/1", "amqp://h//")]
)
def test_a_cache_database_of_its_own_is_accepted(cache, broker):
    check_cache_url(cache, broker)


@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
def test_another_process_reads_the_report_this_one_cached(experiment, sample_store, redis_url, tmp_path):
    _loaded(sample_store)
    f = q.Filters("ttft-opt")
    with override_settings(CACHES=cache_settings(redis_url)):
        first = reports.report_for(experiment, f, sample_store)
        assert first["timing"]["cache"] == "miss"
    raw = redis.Redis.from_url(redis_url)
    keys = [k.decode() for k in raw.keys("*")]
    assert len(keys) == 1 and keys[0].startswith(f"{REPORT_PREFIX}:1:abplat:sla-report:"), keys
    key = keys[0].split(":", 2)[2]

    script = (
        "import json; from django.core.cache import caches; "
        f"r = caches['default'].get({key!r}); "
        "print(json.dumps({'generated_at': r['generated_at'], 'n': [v['n'] for v in r['variants']]}))"
    )
    seen = json.loads(manage(_process_env(tmp_path, redis_url), "shell", "-v0", "-c", script))
    assert seen == {"generated_at": first["generated_at"], "n": [v["n"] for v in first["variants"]]}
    assert sum(seen["n"]) == 2000

    # and a fresh connection of this process (a new cache handler) is served the same entry
    with override_settings(CACHES=cache_settings(redis_url)):
        again = reports.report_for(experiment, f, sample_store)
    assert again["timing"]["cache"] == "hit" and again["generated_at"] == first["generated_at"]


def test_request_rates_are_counted_across_processes(redis_url, tmp_path, settings):
    settings.API_THROTTLE_LOGIN = "5/day"  # a day's window: the count cannot roll over mid-test
    ident = f"client-{uuid.uuid4().hex[:8]}"
    with override_settings(CACHES=cache_settings(redis_url)):
        assert [api.spend("login", ident, "API_THROTTLE_LOGIN") for _ in range(3)] == [None] * 3
        script = (
            "from abplat import api; "
            f"print([api.spend('login', {ident!r}, 'API_THROTTLE_LOGIN') for _ in range(2)])"
        )
        other = manage(
            _process_env(tmp_path, redis_url, ABPLAT_API_THROTTLE_LOGIN="5/day"), "shell", "-v0", "-c", script
        )
        assert other.strip() == "[None, None]"  # requests 4 and 5 of the window
        wait = api.spend("login", ident, "API_THROTTLE_LOGIN")  # the 6th, back in this process
    assert wait is not None and wait > 0
    keys = [k.decode() for k in redis.Redis.from_url(redis_url).keys("*")]
    assert len(keys) == 1 and keys[0].startswith(f"{THROTTLE_PREFIX}:1:abplat:rate:login:"), keys


@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
def test_a_redis_that_is_down_costs_the_cache_not_the_report(experiment, sample_store, caplog):
    _loaded(sample_store)
    f = q.Filters("ttft-opt")
    expected = reports.report_for(experiment, f, sample_store, use_cache=False)
    caplog.set_level(logging.WARNING, logger="dashboards.reports")
    with override_settings(CACHES=cache_settings(f"redis://127.0.0.1:{_closed_port()}/0")):
        first = reports.report_for(experiment, f, sample_store)
        second = reports.report_for(experiment, f, sample_store)
    for report in (first, second):
        assert report["timing"]["cache"] == "unavailable"
        assert [(v["key"], v["n"], v["hits"]) for v in report["variants"]] == [
            (v["key"], v["n"], v["hits"]) for v in expected["variants"]
        ]
    warnings = [r.getMessage() for r in caplog.records if r.name == "dashboards.reports"]
    assert len(warnings) == 2 and all("report cache unavailable" in w for w in warnings)


@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
def test_a_redis_that_hangs_costs_its_timeouts_not_the_report(experiment, sample_store):
    """A listener that accepts and never answers: the socket timeouts end the wait."""
    _loaded(sample_store)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        with override_settings(CACHES=cache_settings(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")):
            report = reports.report_for(experiment, q.Filters("ttft-opt"), sample_store)
    finally:
        stop.set()
        thread.join(5)
        for s in [*held, listener]:
            s.close()
    assert report["timing"]["cache"] == "unavailable"
    assert sum(v["n"] for v in report["variants"]) == 2000


def test_a_redis_that_is_down_leaves_each_process_counting_its_own(settings, caplog):
    settings.API_THROTTLE_LOGIN = "2/day"
    caplog.set_level(logging.WARNING, logger="abplat.api")
    with override_settings(CACHES=cache_settings(f"redis://127.0.0.1:{_closed_port()}/0")):
        spent = [api.spend("login", "198.51.100.7", "API_THROTTLE_LOGIN") for _ in range(3)]
    assert spent[:2] == [None, None] and spent[2] is not None  # still limited, per process
    warnings = [r.getMessage() for r in caplog.records if r.name == "abplat.api"]
    assert len(warnings) == 1 and "request-rate cache unavailable" in warnings[0]  # once per fallback


def test_the_shared_rate_cache_is_tried_again_after_the_fallback(redis_url, settings, monkeypatch):
    settings.API_THROTTLE_LOGIN = "100/day"
    monkeypatch.setattr(api, "RATE_FALLBACK_S", 0.3)
    with override_settings(CACHES=cache_settings(f"redis://127.0.0.1:{_closed_port()}/0")):
        api.spend("login", "198.51.100.8", "API_THROTTLE_LOGIN")
    raw = redis.Redis.from_url(redis_url)
    with override_settings(CACHES=cache_settings(redis_url)):
        api.spend("login", "198.51.100.8", "API_THROTTLE_LOGIN")
        assert raw.keys(f"{THROTTLE_PREFIX}:*") == [], "inside the fallback: counted in the process"
        time.sleep(0.4)
        api.spend("login", "198.51.100.8", "API_THROTTLE_LOGIN")
    assert len(raw.keys(f"{THROTTLE_PREFIX}:*")) == 1, "after it: counted in Redis again"


def test_error_pages_never_show_the_cache_password():
    from abplat.api import RedactingExceptionReporterFilter

    url = "redis://:hunter2secret@cache.internal:6379/1"
    with override_settings(CACHE_URL=url, CACHES=cache_settings(url)):
        safe = RedactingExceptionReporterFilter().get_safe_settings()
    assert "hunter2secret" not in repr(safe)
    assert safe["CACHES"]["default"]["LOCATION"] == "redis://***@cache.internal:6379/1"
