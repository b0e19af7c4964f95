"""The gateway and the web app in one process: ``manage.py gateway --with-web``.

On the embedded default the sample store is chDB, which one process opens at a time: with the
gateway in one process and the web app in another, the dashboard could not read what the
gateway records. ``GatewayAndWeb`` serves both from one ASGI app: the gateway's API paths
(``/v1/...`` and the configured route prefixes' ``/PREFIX/v1/...``) go to the gateway, every
other path to Django (admin, API, dashboards, static files through WhiteNoise), and the
lifespan (start the router, the variants, the recorder; drain and close them) to the gateway
(Django's ASGI handler takes HTTP only).
"""

from __future__ import annotations

from gateway.app import Gateway
from gateway.http import Receive, Scope, Send


class GatewayAndWeb:
    def __init__(self, gateway: Gateway, web) -> None:
        self.gateway = gateway
        self.web = web
        self._prefixes = tuple(prefix + "/v1/" for prefix, _ in gateway.config.routes.prefixes)

    def is_gateway_path(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or path.startswith(self._prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or self.is_gateway_path(scope.get("path", "")):
            return await self.gateway(scope, receive, send)
        return await self.web(scope, receive, send)
