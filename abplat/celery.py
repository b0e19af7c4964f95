"""The Celery app. Settings come from Django's, namespaced CELERY_*; JSON only.

No beat schedule: the one periodic job, flushing the sample spool, must run on every worker host
(only the host that spooled samples can flush them), and beat sends each tick as one message that
one worker takes. Every worker process runs it on a timer thread instead (workers.apps,
start_spool_flusher; workers.tasks.flush_spool, every SPOOL_FLUSH_INTERVAL_S), so no beat
process needs to be deployed; `manage.py flush_samples` does the same by hand.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

app = Celery("abplat")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
