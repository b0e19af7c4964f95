"""python manage.py gateway --port P [--host H] [--workers N] [--with-web]: the live gateway on
uvicorn; with --with-web the web app (admin, API, dashboards) from the same process too."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from gateway.config import GatewayConfig


class Command(BaseCommand):
    help = (
        "Serve the live gateway (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/models) "
        "on uvicorn; settings ABPLAT_GATEWAY_* (README, 'Live traffic')."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
        parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
        parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
        parser.add_argument(
            "--with-web", action="store_true",
            help="serve the web app (admin, API, dashboards) from the same process: /v1/... goes to the "
            "gateway, everything else to Django (the embedded chDB is opened by one process only)",
        )  # fmt: skip

    def handle(self, *args, port: int, host: str, workers: int, log_level: str, with_web: bool = False,
               **opts) -> None:  # fmt: skip
        if not 0 <= port < 65536:
            raise CommandError(f"--port {port}: must be in [0, 65535]")
        if not 1 <= workers <= 256:
            raise CommandError(f"--workers {workers}: must be in [1, 256]")
        if workers > 1 and not settings.CLICKHOUSE_URL:
            raise CommandError(
                f"--workers {workers} needs ABPLAT_CLICKHOUSE_URL: every worker records samples, and the "
                "embedded chDB allows one process per data directory (run one worker, or a ClickHouse server)."
            )
        try:
            GatewayConfig.from_settings()  # a bad setting stops here, naming it, before any worker
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        import uvicorn

        uvicorn.run(
            "gateway.asgi_with_web:application" if with_web else "gateway.asgi:application",
            host=host,
            port=port,
            workers=workers,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            log_level=log_level,
            access_log=False,
            # the variant's own Server and Date headers pass through untouched
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=settings.GATEWAY_DRAIN_S or None,
            timeout_keep_alive=30,
            # Beyond this many connections (and requests) at once, a 503 instead of a queue.
            limit_concurrency=settings.GATEWAY_MAX_CONNECTIONS,
            backlog=4096,
        )
