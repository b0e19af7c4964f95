"""What the web process puts between a caller and the views: bounded API pages, tokens that
expire, request rates, a limit on admin login attempts, and error reports that never show a
credential.

Every limit is a setting (abplat/config.py, docs/security.md) read when the request comes,
so a test or an operator's override takes effect without a restart of anything cached here.
Settings name these classes by dotted path; apps below ``abplat`` never import this module.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from typing import Any

import redis
from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.debug import SafeExceptionReporterFilter
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed, ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.throttling import BaseThrottle

log = logging.getLogger(__name__)

# ---- pages ----------------------------------------------------------------------------------

_WHOLE = re.compile(r"^[0-9]+$")  # ASCII digits only: str.isdigit() accepts "²", int() does not


def _whole(name: str, raw: str, minimum: int) -> int:
    value = int(raw) if _WHOLE.match(raw.strip()) else None
    if value is None or value < minimum:
        raise ValidationError({name: [f"{name} must be a whole number >= {minimum}, got {raw!r}"]})
    return value


class CappedLimitOffsetPagination(LimitOffsetPagination):
    """?limit=&offset= pages of at most API_MAX_PAGE_SIZE rows. A larger or malformed limit is
    a 400 naming the cap, never a silent clamp: a client that asked for everything and got a
    page must not mistake it for everything."""

    def get_limit(self, request) -> int:
        cap = settings.API_MAX_PAGE_SIZE
        raw = request.query_params.get(self.limit_query_param, "")
        if not raw.strip():
            return min(self.default_limit or cap, cap)
        limit = _whole(self.limit_query_param, raw, 1)
        if limit > cap:
            raise ValidationError(
                {self.limit_query_param: [f"limit must be <= {cap} (API_MAX_PAGE_SIZE); page with offset"]}
            )
        return limit

    def get_offset(self, request) -> int:
        raw = request.query_params.get(self.offset_query_param, "")
        return _whole(self.offset_query_param, raw, 0) if raw.strip() else 0


# ---- tokens ---------------------------------------------------------------------------------


class ExpiringTokenAuthentication(TokenAuthentication):
    """DRF tokens that stop working API_TOKEN_TTL_S seconds after they were created: a 401
    "token expired". `manage.py drf_create_token -r USER` issues a fresh one."""

    def authenticate_credentials(self, key: str):
        user, token = super().authenticate_credentials(key)
        ttl = settings.API_TOKEN_TTL_S
        if (timezone.now() - token.created).total_seconds() > ttl:
            raise AuthenticationFailed(
                f"token expired: tokens last {ttl} s (ABPLAT_API_TOKEN_TTL_S); "
                "ask for a new one (manage.py drf_create_token -r USERNAME)"
            )
        return user, token


# ---- request rates --------------------------------------------------------------------------

RATE_CACHE = "throttle"  # its own cache: report entries never evict rate counters
# When the shared rate cache (ABPLAT_CACHE_URL's Redis) fails, each process counts its own
# callers for RATE_FALLBACK_S seconds, as it does without a shared cache, then tries it again:
# neither every request failing nor every caller let through. One warning per fallback.
RATE_FALLBACK_S = 10.0
_local_rates = LocMemCache("abplat-throttle-fallback", {"OPTIONS": {"MAX_ENTRIES": 100_000}})
_shared_down_until = 0.0
_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_rate(name: str, rate: str) -> tuple[int, int]:
    """'600/min' -> (600, 60). Settings check the same form at start (abplat/config.py, _RATE_FORM)."""
    count, _, period = rate.partition("/")
    seconds = _PERIODS.get(period[:1])
    if not _WHOLE.match(count) or seconds is None:
        raise ImproperlyConfigured(f"{name}={rate!r}: use N/s, N/min, N/hour or N/day")
    return int(count), seconds


def spend(scope: str, ident: str, setting: str) -> float | None:
    """Count one request of ``ident`` against the rate in settings.<setting>: None if it is
    allowed, else the seconds until the current window ends.

    A fixed window per (scope, ident) counted with cache.incr: one O(1) cache round trip per
    request (DRF's sliding window rewrites a list as long as the rate, 6000 entries on
    the assign endpoint). A burst of up to twice the rate across a window boundary is the price.
    """
    global _shared_down_until
    count, seconds = parse_rate(setting, getattr(settings, setting))
    now = time.time()
    window = int(now // seconds)
    key = f"abplat:rate:{scope}:{ident}:{seconds}:{window}"
    if time.monotonic() < _shared_down_until:
        used = _count(_local_rates, key, seconds)
    else:
        try:
            used = _count(caches[RATE_CACHE], key, seconds)
        except (redis.RedisError, OSError) as exc:
            _shared_down_until = time.monotonic() + RATE_FALLBACK_S
            log.warning(
                "request-rate cache unavailable (%s): counting in this process for %.0f s",
                exc,
                RATE_FALLBACK_S,
            )
            used = _count(_local_rates, key, seconds)
    return None if used <= count else (window + 1) * seconds - now


def _count(cache: Any, key: str, seconds: int) -> int:
    """One more request in the window ``key``: its count so far."""
    cache.add(key, 0, seconds + 1)
    try:
        return cache.incr(key)
    except ValueError:  # evicted between add and incr
        cache.set(key, 1, seconds + 1)
        return 1


def client_ip(request: HttpRequest) -> str:
    # REMOTE_ADDR, not X-Forwarded-For (anyone can write that header): behind a proxy, list it
    # in ABPLAT_TRUSTED_PROXIES and abplat.proxy puts the client's address there.
    return request.META.get("REMOTE_ADDR") or "unknown"


class ApiThrottle(BaseThrottle):
    """Requests per caller: a view's own ``throttle_scope`` (rate setting API_THROTTLE_<SCOPE>,
    e.g. the assign endpoint's "assign") replaces the general rates, API_THROTTLE_USER per
    signed-in user and API_THROTTLE_ANON per client address. Over the rate: 429 and
    Retry-After."""

    def allow_request(self, request, view) -> bool:
        user = getattr(request, "user", None)
        signed_in = bool(user and user.is_authenticated)
        scope = getattr(view, "throttle_scope", None) or ("user" if signed_in else "anon")
        ident = f"user-{user.pk}" if signed_in else f"ip-{client_ip(request)}"
        self._wait = spend(scope, ident, f"API_THROTTLE_{scope.upper()}")
        return self._wait is None

    def wait(self) -> float | None:
        return getattr(self, "_wait", None)


def limit_login(view):
    """The admin login view with at most API_THROTTLE_LOGIN sign-in attempts (POSTs) per client
    address; more get 429 and Retry-After, without the password being checked."""

    @functools.wraps(view)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method == "POST":
            wait = spend("login", f"ip-{client_ip(request)}", "API_THROTTLE_LOGIN")
            if wait is not None:
                seconds = max(1, math.ceil(wait))
                return HttpResponse(
                    f"Too many sign-in attempts from your address: try again in {seconds} s.\n",
                    status=429,
                    content_type="text/plain; charset=utf-8",
                    headers={"Retry-After": str(seconds)},
                )
        return view(request, *args, **kwargs)

    return limited


# ---- error reports --------------------------------------------------------------------------

# Credentials inside a URL: scheme://user:password@host -> scheme://***@host
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]+@")
# Names of local variables hidden on a traceback's frames; narrower than settings' (a view's
# `key` is an experiment key, and frames are where a developer debugs).
_SECRET_NAMES = re.compile(r"PASS|SECRET|TOKEN|CREDENTIAL|SIGNATURE|API_?KEY|PRIVATE", re.I)


def strip_url_credentials(text: str) -> str:
    return _URL_CREDENTIALS.sub(r"\g<scheme>***@", text)


class RedactingExceptionReporterFilter(SafeExceptionReporterFilter):
    """Django's filter (DEFAULT_EXCEPTION_REPORTER_FILTER) on debug pages and error e-mails,
    with two more rules, whatever the setting's name:

    - every setting, request header or environment variable (request.META holds the process
      environment under runserver) whose name matches KEY|SECRET|PASS|TOKEN|CREDENTIAL|
      SIGNATURE|URL|ENDPOINT|DSN|CERT (and Django's own API|AUTH|HTTP_COOKIE) is hidden;
    - any other string that is a URL with credentials loses them, also inside dicts, lists
      and tuples (DATABASES, CELERY_BROKER_URL, a frame's local variables).

    Active with DEBUG on too: a forgotten ABPLAT_DEBUG=true must not show a password.
    """

    hidden_settings = re.compile(
        "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|CREDENTIAL|URL|ENDPOINT|DSN|CERT",
        flags=re.I,
    )

    def is_active(self, request) -> bool:
        return True

    def cleanse_setting(self, key, value):
        return _strip_nested(super().cleanse_setting(key, value))

    def get_traceback_frame_variables(self, request, tb_frame):
        return [
            (name, self.cleansed_substitute if _SECRET_NAMES.search(name) else self._cleanse_value(value))
            for name, value in super().get_traceback_frame_variables(request, tb_frame)
        ]

    def _cleanse_value(self, value):
        if isinstance(value, dict):
            return {k: self.cleanse_setting(k, v) for k, v in value.items()}
        return _strip_nested(value)


def _strip_nested(value):
    if isinstance(value, str):
        return strip_url_credentials(value)
    if isinstance(value, list):
        return [_strip_nested(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip_nested(v) for v in value)
    if isinstance(value, dict):
        return {k: _strip_nested(v) for k, v in value.items()}
    return value
