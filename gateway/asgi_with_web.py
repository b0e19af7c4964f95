"""The ASGI application of ``manage.py gateway --with-web``: the gateway for its API paths and
the web app for the rest, in one process (gateway/with_web.py)."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
django.setup()

from django.core.asgi import get_asgi_application  # noqa: E402

from gateway.app import build_default  # noqa: E402
from gateway.with_web import GatewayAndWeb  # noqa: E402

application = GatewayAndWeb(build_default(), get_asgi_application())
