"""The web's side of the platform's metrics (telemetry/metrics.py, docs/metrics.md).

- ``RequestMetricsMiddleware`` counts and times every request by its view's name (the URL
  pattern's name, never the path: one series per view, not per experiment key or id).
- ``metrics_view`` serves ``/metrics``: this process's metrics, or with ABPLAT_METRICS_DIR those
  of every process on the machine (gunicorn workers, Celery children), plus replay runs by status
  read from the database.

Who may read it: a client whose address is in ABPLAT_METRICS_ALLOWED_CIDRS (default loopback),
or one that sends ``Authorization: Bearer <token>`` matching ABPLAT_METRICS_TOKEN_FILE. Anyone
else gets 403 and nothing else. The address is REMOTE_ADDR: the connection's peer, or, for a
connection from a proxy listed in ABPLAT_TRUSTED_PROXIES, the client that proxy names
(abplat/proxy.py); X-Forwarded-For from anyone else is never read. The metrics carry no secret: labels are experiment and variant keys, outcomes,
view names and status classes.
"""

from __future__ import annotations

import hmac
import time

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from telemetry import metrics


class RequestMetricsMiddleware:
    """abplat_http_requests_total and abplat_http_request_duration_seconds, by view name."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        view = (match.view_name if match is not None else "") or "unmatched"
        metrics.observe_http(view, request.method or "", response.status_code, time.perf_counter() - started)
        return response


def run_counts() -> dict[str, int]:
    from workers.models import ReplayRun

    return dict(ReplayRun.objects.values_list("status").annotate(n=Count("pk")).order_by())


def allowed(request: HttpRequest) -> bool:
    token = settings.METRICS_TOKEN
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return True
    return metrics.address_allowed(request.META.get("REMOTE_ADDR", ""), settings.METRICS_NETWORKS)


@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not allowed(request):
        return HttpResponse(
            "metrics: refused: the client address is not in ABPLAT_METRICS_ALLOWED_CIDRS and no valid "
            "bearer token (ABPLAT_METRICS_TOKEN_FILE) was sent\n",
            status=403,
            content_type="text/plain; charset=utf-8",
        )
    body, content_type = metrics.exposition([metrics.RunStatesCollector(run_counts)])
    return HttpResponse(body, content_type=content_type)
