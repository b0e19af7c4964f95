"""abplat's settings as a function of an environment: ``settings_from(environ)``.

Embedded defaults, real services by environment variable. Every value comes through a strict
parser of ``abplat.env`` reading the mapping given (``os.environ`` in abplat/settings.py, a dict
in tests), and every check between values runs here: a bad one raises ``ImproperlyConfigured``
whose message is one line naming the variable and what it accepts (manage.py prints it as
``abplat: configuration error: ...`` and exits). Defaults run the whole platform on one machine
with nothing installed: SQLite, Celery eager, chDB, a local weights store.

Below, each setting read from the environment, with what it means, and the Django and Celery
settings built from them (DATABASES, CACHES, STORAGES, REST_FRAMEWORK, CELERY_*, the TLS
hardening with debug off, LOGGING). abplat/settings.py holds the ones no variable changes.

``settings_from`` reads the files settings name (the metrics token, the etcd TLS files, the
variants' CA bundle) to check them, and writes nothing: settings hold values, and what must exist
on disk is made by what needs it. ABPLAT_METRICS_DIR is checked by reading the disk only (it
exists as a directory this process may write, or could be made: telemetry/metrics_config.py,
check_dir_would_work); app start makes it and proves it writable with a file written and removed
when it fixes the metrics mode (workers/apps.py, configure_metrics). The embedded database's
directory is made by its backend on the first connection (abplat/db/sqlite3/base.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from abplat.caches import cache_settings, check_cache_url
from abplat.env import EnvError, Reader
from abplat.proxy import parse_proxies
from experiments.weights.factory import StoreConfigError, etcd_security

# The metrics settings' checks only, never telemetry.metrics: importing that module fixes the
# process's metrics mode, which happens at app start (workers/apps.py, configure_metrics).
from telemetry.metrics_config import MetricsConfigError, multiprocess_dir, parse_networks, read_token_file

BASE_DIR = Path(__file__).resolve().parent.parent

# Request rates as DRF writes them (abplat.api.parse_rate reads them per request).
_RATE_FORM = re.compile(r"^[0-9]+/(s|sec|second|m|min|minute|h|hour|d|day)$")


DEVELOPMENT_SECRET_KEY = "django-insecure-abplat-development-key-never-use-in-production-0123456789"

SECRET_KEY_MISSING = (
    "ABPLAT_SECRET_KEY is not set: a web process with ABPLAT_DEBUG off (the default) signs sessions "
    "and forms with a secret key of at least 50 random characters "
    '(python3 -c "import secrets; print(secrets.token_urlsafe(50))"); for development set '
    "ABPLAT_DEBUG=true (`make dev-env` writes it to .env)."
)


def secret_key_missing(environ: Mapping[str, str]) -> bool:
    """Whether a web process started with ``environ`` would have no secret key: debug off and
    ABPLAT_SECRET_KEY empty (gunicorn.conf.py asks before Django loads). EnvError on a bad
    ABPLAT_DEBUG."""
    env = Reader(environ)
    return not env.env_bool("ABPLAT_DEBUG", False) and not env.env_str("ABPLAT_SECRET_KEY", "")


def require_secret_key() -> None:
    """ImproperlyConfigured(SECRET_KEY_MISSING) unless Django's settings hold a secret key. The
    web entry points call it at start (abplat/wsgi.py, abplat/asgi.py, runserver in manage.py,
    ``gateway --with-web``): every other process starts without a key."""
    from django.conf import settings

    try:
        settings.SECRET_KEY  # noqa: B018 - Django raises on an empty key
    except ImproperlyConfigured:
        raise ImproperlyConfigured(SECRET_KEY_MISSING) from None


def settings_from(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings (upper-case name -> value) that ``environ`` configures, every value and
    every combination checked. Raises ImproperlyConfigured naming the variable otherwise."""
    try:
        return _settings(Reader(environ))
    except EnvError as exc:
        raise ImproperlyConfigured(str(exc)) from None


def _settings(env: Reader) -> dict[str, Any]:
    # Each upper-case name assigned in this function is a setting (returned at the end).
    VAR_DIR = Path(env.env_str("ABPLAT_VAR", str(BASE_DIR / "var"))).resolve()
    # Off unless asked for: make demo and make serve turn it on; the tests set a generated key.
    DEBUG = env.env_bool("ABPLAT_DEBUG", False)
    SECRET_KEY = env.env_str("ABPLAT_SECRET_KEY", "")
    ALLOWED_HOSTS = env.env_list("ABPLAT_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
    DATABASE_URL = env.env_url(
        "ABPLAT_DATABASE_URL", "", schemes=("sqlite", "postgres", "postgresql", "pgsql")
    )
    BROKER_URL = env.env_url("ABPLAT_BROKER_URL", "", schemes=("redis", "rediss", "amqp", "amqps", "pyamqp"))
    ETCD_ENDPOINTS = env.env_endpoints("ABPLAT_ETCD_ENDPOINTS")
    ETCD_PREFIX = env.env_str("ABPLAT_ETCD_PREFIX", "/abplat/experiments/")
    WEIGHTS_DIR = Path(env.env_str("ABPLAT_WEIGHTS_DIR", str(VAR_DIR / "weights")))
    CLICKHOUSE_URL = env.env_url("ABPLAT_CLICKHOUSE_URL", "", schemes=("clickhouse", "clickhouses"))
    CHDB_PATH = Path(env.env_str("ABPLAT_CHDB_PATH", str(VAR_DIR / "chdb")))
    CHDB_DATABASE = env.env_str("ABPLAT_CHDB_DATABASE", "abplat")
    SPOOL_DIR = Path(env.env_str("ABPLAT_SPOOL_DIR", str(VAR_DIR / "spool")))
    CELERY_WORKER_CONCURRENCY = env.env_int("ABPLAT_WORKER_CONCURRENCY", 2, minimum=1, maximum=256)
    LOG_LEVEL = env.env_str("ABPLAT_LOG_LEVEL", "INFO").upper()
    REPLAY_SHARDS = env.env_int("ABPLAT_REPLAY_SHARDS", 2, minimum=1, maximum=256)
    # The longest planned replay schedule started without an explicit confirmation.
    REPLAY_MAX_DURATION_S = env.env_int("ABPLAT_REPLAY_MAX_DURATION_S", 2 * 3600, minimum=1)
    VISIBILITY_TIMEOUT = env.env_int("ABPLAT_VISIBILITY_TIMEOUT", 40 * 60, minimum=5)
    # A running shard whose worker wrote no heartbeat (one a second) for this long is presumed
    # dead: a redelivered message may claim it, flush_samples ends its run (workers.tasks).
    REPLAY_LEASE_S = env.env_int("ABPLAT_REPLAY_LEASE_S", 10, minimum=2, maximum=3600)
    # A mirror run's scoring pass (workers/fidelity_scores.py): at most this many calls to the
    # variants in flight at once, after the run has ended (never beside its latency sampling).
    FIDELITY_SCORE_CONCURRENCY = env.env_int("ABPLAT_FIDELITY_SCORE_CONCURRENCY", 4, minimum=1, maximum=64)
    # TLS variants: empty trusts the system store; a PEM bundle path trusts exactly its CAs.
    VARIANT_CA_BUNDLE = env.env_str("ABPLAT_VARIANT_CA_BUNDLE", "")
    # ---- hardening: docs/security.md says what each one guards ----
    # Uploaded traces live here, named by content hash; the API and admin read traces from here only.
    TRACE_DIR = Path(env.env_str("ABPLAT_TRACE_DIR", str(VAR_DIR / "traces"))).resolve()
    TRACE_MAX_BYTES = env.env_int("ABPLAT_TRACE_MAX_BYTES", 512 * 1024 * 1024, minimum=1024)
    TRACE_MAX_LINE_BYTES = env.env_int("ABPLAT_TRACE_MAX_LINE_BYTES", 1024 * 1024, minimum=256)
    # Where variants may point: host names and CIDRs (checked at validation and at connect time).
    VARIANT_ALLOWED_HOSTS = env.env_list(
        "ABPLAT_VARIANT_ALLOWED_HOSTS", ["localhost", "127.0.0.0/8", "::1/128"]
    )
    # Named variant credentials (auth: {secret: NAME}): one file per name in this directory.
    VARIANT_SECRETS_DIR = env.env_str("ABPLAT_VARIANT_SECRETS_DIR", "")
    # The team product and analyst users join when given their role, and where a document that
    # names no team goes when its author is in no single team (docs/security.md, "Roles"); empty: neither.
    DEFAULT_TEAM = env.env_str("ABPLAT_DEFAULT_TEAM", "default")
    # Caps on one replay request.
    REPLAY_MAX_REQUESTS = env.env_int("ABPLAT_REPLAY_MAX_REQUESTS", 5_000_000, minimum=1)
    REPLAY_MAX_CONCURRENCY = env.env_int("ABPLAT_REPLAY_MAX_CONCURRENCY", 4096, minimum=1)
    REPLAY_MAX_SPEED = env.env_int("ABPLAT_REPLAY_MAX_SPEED", 1000, minimum=1)
    # A shard task covers one window of the schedule at most this long (well inside the task
    # time limits below); windows join without a gap (workers/windows.py).
    REPLAY_WINDOW_S = env.env_int("ABPLAT_REPLAY_WINDOW_S", 300, minimum=1)
    TASK_SOFT_TIME_LIMIT_S = env.env_int("ABPLAT_TASK_SOFT_TIME_LIMIT_S", 30 * 60, minimum=2)
    # Planning a run's prompts (start_replay) is bounded by the calibration's request cap, not
    # by the schedule: its own limit.
    REPLAY_PLAN_TIME_LIMIT_S = env.env_int("ABPLAT_REPLAY_PLAN_TIME_LIMIT_S", 30 * 60, minimum=2)
    # API: the largest page a list returns, throttles, and the report's ClickHouse time budget.
    API_MAX_PAGE_SIZE = env.env_int("ABPLAT_API_MAX_PAGE_SIZE", 1000, minimum=1)
    API_THROTTLE_USER = env.env_str("ABPLAT_API_THROTTLE_USER", "600/min")
    API_THROTTLE_ANON = env.env_str("ABPLAT_API_THROTTLE_ANON", "30/min")
    API_THROTTLE_ASSIGN = env.env_str("ABPLAT_API_THROTTLE_ASSIGN", "6000/min")
    API_THROTTLE_LOGIN = env.env_str("ABPLAT_API_THROTTLE_LOGIN", "10/min")
    API_TOKEN_TTL_S = env.env_int("ABPLAT_API_TOKEN_TTL_S", 30 * 24 * 3600, minimum=60)
    REPORT_MAX_EXECUTION_S = env.env_int("ABPLAT_REPORT_MAX_EXECUTION_S", 60, minimum=1)
    # etcd: TLS client certificates and user/password (all empty: plain, as in development).
    ETCD_CA_CERT = env.env_str("ABPLAT_ETCD_CA_CERT", "")
    ETCD_CERT = env.env_str("ABPLAT_ETCD_CERT", "")
    ETCD_KEY = env.env_str("ABPLAT_ETCD_KEY", "")
    ETCD_USER = env.env_str("ABPLAT_ETCD_USER", "")
    ETCD_PASSWORD = env.env_str("ABPLAT_ETCD_PASSWORD", "")
    # ---- operations: logs and traces (docs/configuration.md, "Logs and traces") ----
    # text: a line for people (context as key=value); json: one object a line for a log store.
    LOG_FORMAT = env.env_choice("ABPLAT_LOG_FORMAT", "text", ("text", "json"))
    # Off by default: the replay exports the parent span of every request it sends (OTLP/HTTP).
    OTEL_ENABLED = env.env_bool("ABPLAT_OTEL_ENABLED", False)
    OTEL_ENDPOINT = env.env_url(
        "ABPLAT_OTEL_ENDPOINT", "http://localhost:4318/v1/traces", schemes=("http", "https")
    )
    OTEL_SERVICE_NAME = env.env_str("ABPLAT_OTEL_SERVICE_NAME", "abplat-replay")
    # ---- operations: production serving and the shared cache (docs/deploy.md) ----
    # Redis for the report cache and the API request-rate counters, shared by every web process
    # (abplat/caches.py); empty: each process keeps its own in memory. A database of its own.
    CACHE_URL = env.env_url("ABPLAT_CACHE_URL", "", schemes=("redis", "rediss"))
    # Origins (https://host[:port]) whose forms may POST here, e.g. the name a TLS proxy serves.
    CSRF_TRUSTED_ORIGINS = env.env_list("ABPLAT_CSRF_TRUSTED_ORIGINS", [])
    # Where `collectstatic` puts the admin's and the API docs' files; WhiteNoise serves them.
    STATIC_ROOT = Path(env.env_str("ABPLAT_STATIC_ROOT", str(VAR_DIR / "static"))).resolve()
    # manifest: content-hashed names cached for a year (needs collectstatic); plain: as named,
    # for tests and a quick look without collectstatic.
    STATIC_STORAGE = env.env_choice("ABPLAT_STATIC_STORAGE", "manifest", ("manifest", "plain"))
    # The TLS proxies in front (addresses or CIDRs): their X-Forwarded-For names the client for
    # the per-address limits and /metrics (abplat/proxy.py). Empty: the peer is the client.
    TRUSTED_PROXIES = env.env_list("ABPLAT_TRUSTED_PROXIES", [])
    # ---- operations: metrics (docs/metrics.md) ----
    # Empty: each process keeps its own metrics (one process: make demo). A directory: every web
    # and worker process of this machine writes its metric files there and /metrics sums them.
    METRICS_DIR = env.env_str("ABPLAT_METRICS_DIR", "")
    # Who may read /metrics: clients from these networks (the connection's peer address), or
    # with a bearer token equal to the token file's content. "none": the token only.
    METRICS_ALLOWED_CIDRS = env.env_list("ABPLAT_METRICS_ALLOWED_CIDRS", ["127.0.0.0/8", "::1/128"])
    METRICS_TOKEN_FILE = env.env_str("ABPLAT_METRICS_TOKEN_FILE", "")
    # A worker host without a web process: the Celery worker's main process serves its
    # machine's metrics on this port (0: off); needs ABPLAT_METRICS_DIR.
    WORKER_METRICS_PORT = env.env_int("ABPLAT_WORKER_METRICS_PORT", 0, minimum=0, maximum=65535)
    WORKER_METRICS_ADDR = env.env_str("ABPLAT_WORKER_METRICS_ADDR", "127.0.0.1")
    # ---- operations: the sample store on a ClickHouse cluster (docs/clickhouse-cluster.md) ----
    # A cluster of the servers' remote_servers config: migrations make every table on each of its
    # servers plus a Distributed table over them; ABPLAT_CLICKHOUSE_URL names one of its servers.
    # Empty: one server (or chDB), as before.
    CLICKHOUSE_CLUSTER = env.env_str("ABPLAT_CLICKHOUSE_CLUSTER", "").strip()
    # ---- operations: the variants' own metrics (docs/measuring.md, "Server metrics") ----
    # During a replay each variant's /metrics (vLLM's vllm:* series) is scraped this often, in
    # whole seconds, into the sample store's server_metrics table (workers/server_metrics.py);
    # 0 turns scraping off.
    SERVER_METRICS_INTERVAL_S = env.env_int("ABPLAT_SERVER_METRICS_INTERVAL_S", 5, minimum=0, maximum=3600)
    # ---- progressive rollouts: the controller (docs/rollouts.md) ----
    # Celery beat runs the rollout controller this often, in whole seconds; decisions of one
    # experiment are at least 0.9 x this apart however many beat or worker processes run.
    ROLLOUT_INTERVAL_S = env.env_int("ABPLAT_ROLLOUT_INTERVAL_S", 60, minimum=1, maximum=86400)
    # A look reads the step through its per-user sums kept in the sample store between looks
    # (rollouts/kept.py): the parts written since the last look, not every request of the step
    # (0.5 s against 20 s at 34M requests, bench/RESULTS.md). Off: every look reads the
    # whole step again.
    ROLLOUT_KEPT_SUMS = env.env_bool("ABPLAT_ROLLOUT_KEPT_SUMS", True)
    # How far behind now the kept sums stay, in whole seconds: what was recorded since is read
    # afresh at every look. A row stored later than this after its recorded time (a store outage
    # that long) builds the sums again, one look reading the whole step; a longer lag reads more
    # at every look (rollouts/kept.py KEEP_LAG_MS).
    ROLLOUT_KEPT_LAG_S = env.env_int("ABPLAT_ROLLOUT_KEPT_LAG_S", 30, minimum=5, maximum=3600)
    # ---- the live gateway: docs/gateway.md, gateway/config.py checks the rest ----
    # keys: every client sends "Authorization: Bearer KEY" listed in the keys file (one
    # "TENANT KEY" a line); none: no client auth (development and tests only).
    GATEWAY_AUTH = env.env_choice("ABPLAT_GATEWAY_AUTH", "keys", ("keys", "none"))
    GATEWAY_KEYS_FILE = env.env_str("ABPLAT_GATEWAY_KEYS_FILE", "")
    # Which user: OpenAI's body field "user", else this request header, else a hash of the key.
    GATEWAY_USER_HEADER = env.env_str("ABPLAT_GATEWAY_USER_HEADER", "").lower()
    # Routes overriding "the request's model is the experiment key": MODEL=EXPERIMENT or
    # /PATH-PREFIX=EXPERIMENT, comma-separated.
    GATEWAY_ROUTES = env.env_list("ABPLAT_GATEWAY_ROUTES", [])
    # An unknown experiment is served by this experiment's control ("": 404 model_not_found).
    GATEWAY_DEFAULT_EXPERIMENT = env.env_str("ABPLAT_GATEWAY_DEFAULT_EXPERIMENT", "")
    # Experiments whose variant, failing before its first byte, is retried once on the control
    # ("*": every experiment).
    GATEWAY_RETRY_ON_CONTROL = env.env_list("ABPLAT_GATEWAY_RETRY_ON_CONTROL", [])
    # Client request headers passed on to the variant (lower case); all others are dropped.
    GATEWAY_FORWARD_HEADERS = env.env_list("ABPLAT_GATEWAY_FORWARD_HEADERS", [])
    GATEWAY_MAX_BODY_BYTES = env.env_int("ABPLAT_GATEWAY_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1024)
    # Which experiments each tenant may reach: TENANT=EXPERIMENT, TENANT=team:NAME or TENANT=*,
    # comma-separated (empty: every tenant reaches every running experiment).
    GATEWAY_REACH = env.env_list("ABPLAT_GATEWAY_REACH", [])
    # Per-user token bucket: requests per second (0: no limit) and the burst above it.
    GATEWAY_USER_RATE = env.env_int("ABPLAT_GATEWAY_USER_RATE", 0, minimum=0, maximum=1_000_000)
    GATEWAY_USER_BURST = env.env_int("ABPLAT_GATEWAY_USER_BURST", 20, minimum=1, maximum=1_000_000)
    # Per-tenant (API key owner) token bucket and concurrent requests (0: no limit), whatever
    # user ids its requests carry.
    GATEWAY_TENANT_RATE = env.env_int("ABPLAT_GATEWAY_TENANT_RATE", 0, minimum=0, maximum=1_000_000)
    GATEWAY_TENANT_BURST = env.env_int("ABPLAT_GATEWAY_TENANT_BURST", 100, minimum=1, maximum=1_000_000)
    GATEWAY_TENANT_STREAMS = env.env_int("ABPLAT_GATEWAY_TENANT_STREAMS", 0, minimum=0, maximum=1_000_000)
    # Where those limits are counted: empty, by each gateway process alone; a Redis URL, by every
    # gateway process that names the same Redis (gateway/shared_limits.py). Each call to it may
    # take this many milliseconds before the process falls back to its own count.
    GATEWAY_LIMITS_URL = env.env_url("ABPLAT_GATEWAY_LIMITS_URL", "", schemes=("redis", "rediss"))
    GATEWAY_LIMITS_TIMEOUT_MS = env.env_int("ABPLAT_GATEWAY_LIMITS_TIMEOUT_MS", 50, minimum=1, maximum=5000)
    # The whole request body must arrive within this many seconds (408 otherwise), and at most
    # this many connections are served at once per process (503 beyond: uvicorn's limit).
    GATEWAY_BODY_TIMEOUT_S = env.env_int("ABPLAT_GATEWAY_BODY_TIMEOUT_S", 30, minimum=1, maximum=3600)
    GATEWAY_MAX_CONNECTIONS = env.env_int(
        "ABPLAT_GATEWAY_MAX_CONNECTIONS", 2048, minimum=1, maximum=1_000_000
    )
    # A request's headers must arrive within this many seconds of its first byte (of the
    # connection's opening, for its first request), and be at most this many bytes (431 above;
    # the web process's gunicorn takes a line of 8190 and 100 fields): gateway/http_protocol.py.
    GATEWAY_CLIENT_HEADERS_TIMEOUT_S = env.env_int(
        "ABPLAT_GATEWAY_CLIENT_HEADERS_TIMEOUT_S", 10, minimum=1, maximum=3600
    )
    GATEWAY_MAX_HEADER_BYTES = env.env_int(
        "ABPLAT_GATEWAY_MAX_HEADER_BYTES", 64 * 1024, minimum=8 * 1024, maximum=1024 * 1024
    )
    # Upstream deadlines, seconds: connect, response headers, gap between chunks, whole request.
    GATEWAY_CONNECT_TIMEOUT_S = env.env_int("ABPLAT_GATEWAY_CONNECT_TIMEOUT_S", 5, minimum=1, maximum=600)
    GATEWAY_HEADERS_TIMEOUT_S = env.env_int("ABPLAT_GATEWAY_HEADERS_TIMEOUT_S", 60, minimum=1, maximum=3600)
    GATEWAY_STALL_TIMEOUT_S = env.env_int("ABPLAT_GATEWAY_STALL_TIMEOUT_S", 60, minimum=1, maximum=3600)
    GATEWAY_TOTAL_TIMEOUT_S = env.env_int("ABPLAT_GATEWAY_TOTAL_TIMEOUT_S", 600, minimum=1, maximum=86400)
    # On SIGTERM: stop accepting, let running streams finish for up to this long.
    GATEWAY_DRAIN_S = env.env_int("ABPLAT_GATEWAY_DRAIN_S", 30, minimum=0, maximum=3600)
    # How often the variants' endpoints, models and secrets are re-read from the database.
    GATEWAY_VARIANTS_REFRESH_S = env.env_int("ABPLAT_GATEWAY_VARIANTS_REFRESH_S", 5, minimum=1, maximum=3600)
    # Shadows (answers re-sent to the control, docs/gateway.md) in flight at most per gateway
    # process; one more is skipped and counted, never queued. 0: no shadow is sent.
    GATEWAY_SHADOWS_IN_FLIGHT = env.env_int("ABPLAT_GATEWAY_SHADOWS_IN_FLIGHT", 8, minimum=0, maximum=10_000)

    # ---- checks between values, and values built from them ----
    if CLICKHOUSE_CLUSTER and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", CLICKHOUSE_CLUSTER):
        raise ImproperlyConfigured(
            f"Unexpected value ABPLAT_CLICKHOUSE_CLUSTER={CLICKHOUSE_CLUSTER!r}: the name of a cluster "
            "in the ClickHouse servers' remote_servers config (letters, digits, _), or empty for one server."
        )
    if CLICKHOUSE_CLUSTER and not CLICKHOUSE_URL:
        raise ImproperlyConfigured(
            f"ABPLAT_CLICKHOUSE_CLUSTER={CLICKHOUSE_CLUSTER} needs ABPLAT_CLICKHOUSE_URL: the URL of one "
            "server of that cluster (the embedded chDB is a single process)."
        )

    # Metrics (docs/metrics.md): the multiprocess directory, checked as telemetry.metrics will
    # take it from the process environment at app start (here a bad one, or a clash with
    # PROMETHEUS_MULTIPROC_DIR, stops the process with one line; reading the disk only, app start
    # makes the directory), and who may read /metrics.
    try:
        multiprocess_dir(env.environ, make=False)
        METRICS_NETWORKS = parse_networks(METRICS_ALLOWED_CIDRS, "ABPLAT_METRICS_ALLOWED_CIDRS")
        METRICS_TOKEN = read_token_file(METRICS_TOKEN_FILE, "ABPLAT_METRICS_TOKEN_FILE")
    except MetricsConfigError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    if not METRICS_NETWORKS and not METRICS_TOKEN:
        raise ImproperlyConfigured(
            "ABPLAT_METRICS_ALLOWED_CIDRS=none and no ABPLAT_METRICS_TOKEN_FILE: nobody could read "
            "/metrics; give networks, a token file, or both."
        )
    if WORKER_METRICS_PORT and not METRICS_DIR:
        raise ImproperlyConfigured(
            f"ABPLAT_WORKER_METRICS_PORT={WORKER_METRICS_PORT} needs ABPLAT_METRICS_DIR: the worker's "
            "pool processes write their metrics there and its main process serves them all."
        )
    # Prometheus scrapes the web process directly, over plain HTTP (not through the TLS proxy).
    SECURE_REDIRECT_EXEMPT = [r"^metrics$"]

    if not ETCD_PREFIX.startswith("/") or not ETCD_PREFIX.endswith("/"):
        raise ImproperlyConfigured(
            f"Unexpected value ABPLAT_ETCD_PREFIX={ETCD_PREFIX!r}: it must start and end with '/'."
        )
    try:
        check_cache_url(CACHE_URL, BROKER_URL)
        TRUSTED_PROXY_NETWORKS = parse_proxies(TRUSTED_PROXIES)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    for origin in CSRF_TRUSTED_ORIGINS:
        parts = urlsplit(origin)
        if parts.scheme not in {"http", "https"} or not parts.hostname or parts.path not in {"", "/"}:
            raise ImproperlyConfigured(
                f"Unexpected value ABPLAT_CSRF_TRUSTED_ORIGINS item {origin!r}: use scheme://host[:port] "
                "(e.g. https://abplat.example.com), comma-separated; *.domain is allowed as the host."
            )
    if VARIANT_CA_BUNDLE and not Path(VARIANT_CA_BUNDLE).is_file():
        raise ImproperlyConfigured(
            f"Unexpected value ABPLAT_VARIANT_CA_BUNDLE={VARIANT_CA_BUNDLE!r}: no such file "
            "(the PEM bundle of the CAs that sign the variants' TLS certificates)."
        )
    if REPLAY_WINDOW_S * 2 > TASK_SOFT_TIME_LIMIT_S:
        raise ImproperlyConfigured(
            f"ABPLAT_REPLAY_WINDOW_S={REPLAY_WINDOW_S} must be at most half of "
            f"ABPLAT_TASK_SOFT_TIME_LIMIT_S={TASK_SOFT_TIME_LIMIT_S}: a shard task lasts its window, "
            "plus the lead before it and the requests still in flight at its end."
        )
    if ETCD_CA_CERT or ETCD_CERT or ETCD_KEY or ETCD_USER or ETCD_PASSWORD:
        # Pairs given together, files present, readable and PEM: a bad one stops every process
        # at start (web, workers, commands) rather than at the first etcd call.
        try:
            etcd_security(
                ETCD_CA_CERT, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD, endpoints=ETCD_ENDPOINTS
            )
        except StoreConfigError as exc:
            raise ImproperlyConfigured(str(exc)) from None
    if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ImproperlyConfigured(
            f"Unexpected value ABPLAT_LOG_LEVEL={LOG_LEVEL!r}: use DEBUG, INFO, WARNING or ERROR."
        )
    for name, rate in (
        ("ABPLAT_API_THROTTLE_USER", API_THROTTLE_USER),
        ("ABPLAT_API_THROTTLE_ANON", API_THROTTLE_ANON),
        ("ABPLAT_API_THROTTLE_ASSIGN", API_THROTTLE_ASSIGN),
        ("ABPLAT_API_THROTTLE_LOGIN", API_THROTTLE_LOGIN),
    ):
        if not _RATE_FORM.match(rate):
            raise ImproperlyConfigured(
                f"Unexpected value {name}={rate!r}: use N/s, N/min, N/hour or N/day (e.g. 600/min)."
            )

    if not SECRET_KEY and DEBUG:
        # Development only (ABPLAT_DEBUG=true: make demo, make serve): a fixed, clearly-marked key
        # so sessions survive restarts.
        SECRET_KEY = DEVELOPMENT_SECRET_KEY
    # Debug off and no key: SECRET_KEY stays empty. Only what signs needs it (sessions, CSRF,
    # signed values: Django refuses to read an empty key), so a command or a worker starts
    # without one; the web entry points refuse to start (require_secret_key below).

    if DATABASE_URL:
        DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
    else:
        # The embedded SQLite file in VAR_DIR: Django's SQLite backend, which makes the file's
        # directory on its first connection (abplat/db/sqlite3/base.py).
        DATABASES = {
            "default": {
                "ENGINE": "abplat.db.sqlite3",
                "NAME": VAR_DIR / "abplat.sqlite3",
                # Replay workers and the web process write at once in the embedded mode.
                "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
                # A file, not shared-cache memory: threads of a test (a replay and its progress
                # reporting) then wait on each other's writes instead of failing "table is locked".
                "TEST": {"NAME": str(VAR_DIR / "test.sqlite3")},
            }
        }

    # STATIC_ROOT: ABPLAT_STATIC_ROOT above. WhiteNoise (middleware) serves it with debug off.
    STORAGES = {
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
        "staticfiles": {
            "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if STATIC_STORAGE == "manifest"
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        },
    }

    # The report cache (dashboards/reports.py) and, apart so report entries never evict them, the
    # request-rate counters (abplat/api.py): in each process's memory, or on ABPLAT_CACHE_URL's
    # Redis, shared by every web process (abplat/caches.py).
    CACHES = cache_settings(CACHE_URL)

    REST_FRAMEWORK = {
        "DEFAULT_AUTHENTICATION_CLASSES": [
            # Token first: an anonymous caller gets 401 with a WWW-Authenticate header. Tokens
            # expire API_TOKEN_TTL_S after they were created.
            "abplat.api.ExpiringTokenAuthentication",
            "rest_framework.authentication.SessionAuthentication",
        ],
        "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
        "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
        # ?limit= up to API_MAX_PAGE_SIZE (a larger one is a 400); PAGE_SIZE without it.
        "DEFAULT_PAGINATION_CLASS": "abplat.api.CappedLimitOffsetPagination",
        "PAGE_SIZE": min(100, API_MAX_PAGE_SIZE),
        # API_THROTTLE_USER / _ANON, or the view's own scope (the assign endpoint: API_THROTTLE_ASSIGN).
        "DEFAULT_THROTTLE_CLASSES": ["abplat.api.ApiThrottle"],
    }

    # Celery: eager in-process by default; a broker URL switches to real workers.
    # Eager mode still builds a connection object: a hostname keeps kombu from warning on every replay.
    CELERY_BROKER_URL = BROKER_URL or "memory://localhost/"
    CELERY_TASK_ALWAYS_EAGER = not BROKER_URL
    CELERY_TASK_EAGER_PROPAGATES = True
    CELERY_RESULT_BACKEND = None
    CELERY_TASK_IGNORE_RESULT = True
    CELERY_ACCEPT_CONTENT = ["json"]
    CELERY_TASK_SERIALIZER = "json"
    CELERY_RESULT_SERIALIZER = "json"
    CELERY_TASK_ACKS_LATE = True
    CELERY_TASK_REJECT_ON_WORKER_LOST = True
    CELERY_WORKER_PREFETCH_MULTIPLIER = 1
    CELERY_TASK_SOFT_TIME_LIMIT = TASK_SOFT_TIME_LIMIT_S
    CELERY_TASK_TIME_LIMIT = TASK_SOFT_TIME_LIMIT_S + max(1, TASK_SOFT_TIME_LIMIT_S // 6)
    # A task held by a worker that died comes back after this many seconds (Redis transport).
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 2,
        "unacked_restore_throttle": 1,
    }
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

    if not DEBUG:
        # Behind TLS termination; what only TLS can fix is listed in docs/configuration.md (check --deploy).
        SESSION_COOKIE_SECURE = env.env_bool("ABPLAT_SECURE_COOKIES", True)
        CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
        SECURE_CONTENT_TYPE_NOSNIFF = True
        X_FRAME_OPTIONS = "DENY"
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
        SECURE_SSL_REDIRECT = env.env_bool("ABPLAT_SSL_REDIRECT", True)
        SECURE_HSTS_SECONDS = env.env_int("ABPLAT_HSTS_SECONDS", 31536000, minimum=0)
        SECURE_HSTS_INCLUDE_SUBDOMAINS = True
        SECURE_HSTS_PRELOAD = True
        if SECRET_KEY and (len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5):
            raise ImproperlyConfigured(
                "ABPLAT_SECRET_KEY is too weak: use at least 50 characters with at least 5 distinct ones."
            )

    if not OTEL_ENDPOINT:
        raise ImproperlyConfigured(
            "ABPLAT_OTEL_ENDPOINT is empty: give the collector's OTLP/HTTP URL "
            "(e.g. http://localhost:4318/v1/traces), or leave it unset for that default."
        )
    if not OTEL_SERVICE_NAME or len(OTEL_SERVICE_NAME) > 255 or not OTEL_SERVICE_NAME.isprintable():
        raise ImproperlyConfigured(
            f"Unexpected value ABPLAT_OTEL_SERVICE_NAME={OTEL_SERVICE_NAME!r}: use 1-255 printable characters."
        )

    # Context fields (experiment, run, shard, variant, request_id, task_id: telemetry/logs.py) on
    # every line; Celery workers log through this too (abplat/celery.py).
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "text": {"()": "telemetry.logs.TextFormatter"},
            "json": {"()": "telemetry.logs.JsonFormatter"},
        },
        "filters": {"context": {"()": "telemetry.logs.ContextFilter"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["context"]}
        },
        "root": {"handlers": ["console"], "level": "WARNING"},
        "loggers": {
            "celery": {"level": LOG_LEVEL},
            "abplat": {"level": LOG_LEVEL},
            "experiments": {"level": LOG_LEVEL},
            "workers": {"level": LOG_LEVEL},
            "samples": {"level": LOG_LEVEL},
            "dashboards": {"level": LOG_LEVEL},
            # The driver logs each failed connect with its traceback; the store's wrapper retries
            # and says in one line what failed and what to do (samples/backends).
            "clickhouse_driver.connection": {"level": "ERROR"},
        },
    }

    return {name: value for name, value in locals().items() if name.isupper()}
