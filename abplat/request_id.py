"""Every web request gets an id: the lines it logs carry it (``request_id``), and the response
says it (``X-Request-Id``), so a user's error report finds its log lines.

A caller (a proxy, a client) may send its own ``X-Request-Id``; it is kept when it is a plain
token (letters, digits, ``-_.:``, at most 128 characters), else a new one is generated: a value
from outside never reaches a log line or a response header unchecked.
"""

from __future__ import annotations

import re
import uuid

from django.utils.log import log_response

from telemetry.logs import log_context

HEADER = "X-Request-Id"
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def request_id_from(value: str | None) -> str:
    """The caller's id when it is a plain token, else a new random one (32 hex digits)."""
    if value and _VALID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request_id = request_id_from(request.headers.get(HEADER))
        request.request_id = request_id
        with log_context(request_id=request_id):
            response = self.get_response(request)
            if response.status_code >= 400:
                # Django logs an error response after the middleware returns, outside this
                # context; logged here (the same line), it carries the id (and is not logged twice).
                log_response(
                    "%s: %s", response.reason_phrase, request.path, response=response, request=request
                )
        response[HEADER] = request_id
        return response
