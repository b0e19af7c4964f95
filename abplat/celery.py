"""The Celery app. Settings come from Django's, namespaced CELERY_*; JSON only."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

app = Celery("abplat")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
