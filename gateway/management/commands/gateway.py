"""python manage.py gateway --port P [--host H] [--workers N] [--with-web]: the live gateway on
uvicorn; with --with-web the web app (admin, API, dashboards) from the same process too."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError

from experiments.cli import Command as AbplatCommand
from experiments.cli import require_secret_key
from gateway.config import GatewayConfig


class Command(AbplatCommand):
    help = (
        "Serve the live gateway (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/models) "
        "on uvicorn; settings ABPLAT_GATEWAY_* (docs/gateway.md)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
        parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
        parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
        parser.add_argument(
            "--with-web",
            action="store_true",
            help="serve the web app (admin, API, dashboards) from the same process: /v1/... goes to the "
            "gateway, everything else to Django (the embedded chDB is opened by one process only)",
        )

    def handle(
        self, *args, port: int, host: str, workers: int, log_level: str, with_web: bool = False, **opts
    ) -> None:
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
        if with_web:
            require_secret_key("--with-web")
        config = server_config(
            "gateway.asgi_with_web:application" if with_web else "gateway.asgi:application",
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
        )
        web = " and the web app at {where}/" if with_web else ""
        ready = (
            "gateway: {verb} {where}/v1 (OpenAI-compatible)" + web + f", {workers} worker process(es); "
            "Ctrl-C drains the running streams and stops"
        )
        if workers > 1:
            # each worker process starts its own app: the socket is bound before they are up
            from uvicorn.supervisors import Multiprocess

            sock = config.bind_socket()
            self._say(ready.format(verb="starting on", where=_url(host, sock.getsockname()[1])))
            Multiprocess(config, sockets=[sock]).run()
            return
        server = _announcing_server(
            config, lambda bound: self._say(ready.format(verb="serving", where=_url(host, bound)))
        )
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            raise CommandError(f"the gateway did not start on {_url(host, port)} (its log above says why)")

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()  # a pipe (a supervisor's log, a script waiting for it) sees it now


def server_config(app, **options):
    """uvicorn's Config for the gateway process (``app``: an import string or, in tests, the app)."""
    import uvicorn

    return uvicorn.Config(
        app,
        loop="uvloop",
        # httptools with a deadline and a size bound on each request's headers
        http="gateway.http_protocol:BoundedHttpToolsProtocol",
        lifespan="on",
        access_log=False,
        # the variant's own Server and Date headers pass through untouched
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=settings.GATEWAY_DRAIN_S or None,
        timeout_keep_alive=30,
        # Beyond this many connections (and requests) at once, a 503 instead of a queue.
        limit_concurrency=settings.GATEWAY_MAX_CONNECTIONS,
        backlog=4096,
        # X-Forwarded-For and -Proto are believed as abplat/proxy.py says (ABPLAT_TRUSTED_PROXIES,
        # in the web app's middleware), never by uvicorn's own rule (loopback, whatever is set).
        proxy_headers=False,
        **options,
    )


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _announcing_server(config, announce):
    """uvicorn's Server that calls ``announce(port)`` once it listens (after its lifespan startup:
    the router loaded, the recorder open, the socket bound), so a person knows when to send the
    first request."""
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                announce(self.servers[0].sockets[0].getsockname()[1])

    return AnnouncingServer(config)
