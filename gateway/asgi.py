"""The ASGI application uvicorn imports in each gateway worker process (``manage.py gateway``)."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
django.setup()

from gateway.app import build_default  # noqa: E402

application = build_default()
