"""gunicorn settings for abplat's web process (docs/deploy.md).

    gunicorn -c gunicorn.conf.py abplat.wsgi

gunicorn reads this file by itself when started in the project directory. Every value comes from
an ``ABPLAT_WEB_*`` variable through the strict parsers of abplat/env.py (a bad one stops the
server at start naming the variable); a flag on gunicorn's command line overrides this file.

Threaded workers (gthread): a report can take up to ABPLAT_REPORT_MAX_EXECUTION_S and a trace
upload as long as the client's link allows; a thread waits on them while the worker's other
threads keep answering, and ``timeout`` only restarts a worker whose main loop is stuck.
No ``preload_app``: each worker builds its own router, etcd watch and database connections
after the fork (gRPC channels and sockets do not survive a fork).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
env = importlib.import_module("abplat.env")
_config = importlib.import_module("abplat.config")  # not "config": a gunicorn setting


def _setting(parse, *args, **kwargs):
    try:
        return parse(*args, **kwargs)
    except env.EnvError as exc:
        sys.exit(f"abplat: configuration error: {exc}")


# The development settings file (.env beside manage.py) when there is one, under the
# environment; the workers inherit what it set.
_setting(env.load_env_file, os.environ)
# The web process signs sessions and forms: no key with debug off stops the server here, in one
# line, before a worker loads the application (abplat/wsgi.py would refuse with a traceback).
if _setting(_config.secret_key_missing, os.environ):
    sys.exit(f"abplat: configuration error: {_config.SECRET_KEY_MISSING}")

# chDB (no ABPLAT_CLICKHOUSE_URL) can be opened by one process only: one worker then.
_EMBEDDED_STORE = not _setting(
    env.env_url, "ABPLAT_CLICKHOUSE_URL", "", schemes=("clickhouse", "clickhouses")
)

bind = _setting(env.env_list, "ABPLAT_WEB_BIND", ["127.0.0.1:8000"])
workers = _setting(
    env.env_int,
    "ABPLAT_WEB_WORKERS",
    1 if _EMBEDDED_STORE else min(2 * (os.cpu_count() or 1) + 1, 8),
    minimum=1,
    maximum=64,
)
worker_class = "gthread"
threads = _setting(env.env_int, "ABPLAT_WEB_THREADS", 4, minimum=1, maximum=64)
timeout = _setting(env.env_int, "ABPLAT_WEB_TIMEOUT", 60, minimum=5)
graceful_timeout = _setting(env.env_int, "ABPLAT_WEB_GRACEFUL_TIMEOUT", 30, minimum=1)
# Behind a proxy that keeps connections to us open (nginx `keepalive` upstream, docs/deploy.md).
keepalive = _setting(env.env_int, "ABPLAT_WEB_KEEPALIVE", 5, minimum=0)
# Restart a worker after this many requests (0: never), spread by up to 10% so they do not all
# restart at once.
max_requests = _setting(env.env_int, "ABPLAT_WEB_MAX_REQUESTS", 0, minimum=0)
max_requests_jitter = max_requests // 10
# Addresses whose X-Forwarded-Proto gunicorn believes (the TLS proxy); Django reads the same
# header (SECURE_PROXY_SSL_HEADER) to know a request came over TLS.
forwarded_allow_ips = ",".join(_setting(env.env_list, "ABPLAT_WEB_FORWARDED_ALLOW_IPS", ["127.0.0.1", "::1"]))
# Request lines and headers gunicorn accepts: its defaults, named so a proxy can match them.
limit_request_line = 8190
limit_request_fields = 100

# Logs on stdout/stderr for the service manager (journald, a Procfile runner). The access log
# adds the duration in milliseconds to the combined format; ABPLAT_WEB_ACCESS_LOG=false when the
# proxy keeps its own.
errorlog = "-"
accesslog = "-" if _setting(env.env_bool, "ABPLAT_WEB_ACCESS_LOG", True) else None
# The request id (X-Request-Id, abplat/request_id.py) ties a line to the application's logs.
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" %(M)sms %({x-request-id}o)s'
loglevel = _setting(env.env_choice, "ABPLAT_LOG_LEVEL", "info", ("debug", "info", "warning", "error"))
if _setting(env.env_choice, "ABPLAT_LOG_FORMAT", "text", ("text", "json")) == "json":
    # One JSON object a line, like every other abplat process (telemetry/logs.py): gunicorn's
    # own lines and the access log (the line above as its "message").
    logconfig_dict = {
        "root": {"level": "WARNING", "handlers": ["error_console"]},
        "loggers": {
            "gunicorn.error": {"level": loglevel.upper(), "handlers": ["error_console"], "propagate": False},
            "gunicorn.access": {
                "level": "INFO" if accesslog else "WARNING",
                "handlers": ["console"],
                "propagate": False,
            },
        },
        "formatters": {"generic": {"()": "telemetry.logs.JsonFormatter"}},
    }
proc_name = "abplat-web"
# gunicorn's control socket (`gunicornc`): off unless given a path. Its default is one path per
# user ($HOME/.gunicorn/gunicorn.ctl), which a second server of the same user would take over.
_control_socket = _setting(env.env_str, "ABPLAT_WEB_CONTROL_SOCKET", "")
if _control_socket:
    control_socket = _control_socket
else:
    control_socket_disable = True


def on_starting(server):
    """Refuse several workers on the embedded store, whichever way they were asked for."""
    if _EMBEDDED_STORE and server.cfg.workers > 1:
        sys.exit(
            f"abplat: configuration error: {server.cfg.workers} web workers need a ClickHouse "
            "server (ABPLAT_CLICKHOUSE_URL): the embedded store (chDB) can be opened by one "
            "process only. Set ABPLAT_WEB_WORKERS=1 or configure ClickHouse."
        )


def child_exit(server, worker):
    """A worker process ended: its live Prometheus gauges go with it (multiprocess mode,
    ABPLAT_METRICS_DIR; a no-op without it). Imported here so the master loads the metrics
    module only when a worker exits."""
    from telemetry.metrics import gunicorn_child_exit

    gunicorn_child_exit(server, worker)
