"""abplat's Django settings.

Every setting read from the environment, with what it means and what it accepts, is in
abplat/config.py, with the checks between them and the Django and Celery settings built from them
(DATABASES, CACHES, STORAGES, REST_FRAMEWORK, CELERY_*, the TLS hardening with debug off,
LOGGING): ``settings_from(os.environ)`` returns them and they become this module's names below. A
bad value stops the process here, before Django starts, with one line naming the variable
(manage.py). This module holds the settings no variable changes.
"""

from __future__ import annotations

import os

from abplat.config import BASE_DIR, settings_from

_environment_settings = settings_from(os.environ)
globals().update(_environment_settings)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "experiments",
    "workers",
    "traces",
    "samples",
    "dashboards",
    "serving",
    "simulator",  # its one command: manage.py simulator
    "rollouts",
    "capacity",
    "gateway",
]

MIDDLEWARE = [
    "abplat.request_id.RequestIdMiddleware",  # first: every line of a request carries its id
    "abplat.metrics.RequestMetricsMiddleware",  # counts and times every request by view name
    # The client's address, not the proxy's, for every view (ABPLAT_TRUSTED_PROXIES).
    "abplat.proxy.TrustedProxyMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files with debug off, before anything that would touch a session or the database.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "abplat.urls"
WSGI_APPLICATION = "abplat.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# STATIC_ROOT and STORAGES (ABPLAT_STATIC_ROOT, ABPLAT_STATIC_STORAGE): abplat/config.py.
LOGIN_URL = "/admin/login/"

# Debug pages and error e-mails hide credentials whatever the setting is called (abplat/api.py).
DEFAULT_EXCEPTION_REPORTER_FILTER = "abplat.api.RedactingExceptionReporterFilter"

SPECTACULAR_SETTINGS = {
    "TITLE": "abplat API",
    "DESCRIPTION": "A/B experiments and streaming SLA observability for LLM serving.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Swagger UI served from our own static files: no CDN needed (closed networks).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # One name for the trace formats (a trace's, a run's source): the same two choices.
    "ENUM_NAME_OVERRIDES": {"TraceFormatEnum": "traces.models.Trace.Format"},
}
