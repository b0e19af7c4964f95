"""The two Django caches: the report cache (``default``, dashboards/reports.py) and the request
rate counters (``throttle``, abplat/api.py).

Without ``ABPLAT_CACHE_URL`` both live in each process's memory, as they always did: every web
process computes its own reports and counts its own callers. With a Redis URL both go to that
Redis (Django's own ``RedisCache``), so every web process reads the reports another computed and
the request rates are counted across all of them; key prefixes keep the two apart in one Redis
database. No Django imports: abplat/config.py builds ``CACHES`` with this before Django is set up.
"""

from __future__ import annotations

from urllib.parse import urlsplit

REDIS_BACKEND = "django.core.cache.backends.redis.RedisCache"
LOCMEM_BACKEND = "django.core.cache.backends.locmem.LocMemCache"
# A Redis that is down or unreachable must cost a request little: the report is computed and
# the rates counted in the process instead (dashboards/reports.py, abplat/api.py).
CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 2.0
REPORT_PREFIX = "abplat-report"
THROTTLE_PREFIX = "abplat-throttle"


def cache_settings(cache_url: str) -> dict[str, dict]:
    """Django's CACHES for ``cache_url`` (redis:// or rediss://; empty: per-process memory)."""
    if not cache_url:
        return {
            "default": {"BACKEND": LOCMEM_BACKEND, "LOCATION": "abplat"},
            # Apart so report entries never evict the rate counters.
            "throttle": {
                "BACKEND": LOCMEM_BACKEND,
                "LOCATION": "abplat-throttle",
                "OPTIONS": {"MAX_ENTRIES": 100_000},
            },
        }
    options = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S}
    return {
        "default": {
            "BACKEND": REDIS_BACKEND,
            "LOCATION": cache_url,
            "KEY_PREFIX": REPORT_PREFIX,
            "OPTIONS": dict(options),
        },
        "throttle": {
            "BACKEND": REDIS_BACKEND,
            "LOCATION": cache_url,
            "KEY_PREFIX": THROTTLE_PREFIX,
            "OPTIONS": dict(options),
        },
    }


def redis_database(url: str) -> tuple[str, int, int] | None:
    """(host, port, database number) of a redis:// or rediss:// URL; None for other schemes."""
    parts = urlsplit(url)
    if parts.scheme not in {"redis", "rediss"}:
        return None
    path = parts.path.strip("/")
    db = int(path) if path.isdigit() else 0
    for name, value in (part.split("=", 1) for part in parts.query.split("&") if "=" in part):
        if name == "db" and value.isdigit():
            db = int(value)
    return (parts.hostname or "", parts.port or 6379, db)


def check_cache_url(cache_url: str, broker_url: str) -> None:
    """ValueError for a cache URL whose path is not a database number, or one that shares the
    broker's Redis database: clearing a Django Redis cache empties its whole database (FLUSHDB),
    queued replay tasks included."""
    if not cache_url:
        return
    path = urlsplit(cache_url).path.strip("/")
    if path and not path.isdigit():
        raise ValueError(
            f"Unexpected value ABPLAT_CACHE_URL={cache_url!r}: the path must be a Redis database "
            "number (redis://host:6379/1)."
        )
    cache_db = redis_database(cache_url)
    if cache_db is not None and broker_url and redis_database(broker_url) == cache_db:
        host, port, db = cache_db
        raise ValueError(
            f"ABPLAT_CACHE_URL and ABPLAT_BROKER_URL name the same Redis database ({host}:{port}/{db}): "
            "give the cache a database of its own (e.g. /1), since clearing the cache empties "
            "its whole database, queued tasks included."
        )
