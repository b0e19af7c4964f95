"""The Celery app. Settings come from Django's, namespaced CELERY_*; JSON only.

Beat runs one schedule, the rollout controller (``schedule_rollouts`` below). The spool flush is
not on it: flushing the sample spool must run on every worker host
(only the host that spooled samples can flush them), and beat sends each tick as one message that
one worker takes. Every worker process runs it on a timer thread instead (workers.apps,
start_spool_flusher; workers.tasks.flush_spool, every SPOOL_FLUSH_INTERVAL_S), so flushing needs
no beat process; `manage.py flush_samples` does the same by hand.

The development settings file (.env, abplat/env.py) is read first, before Django's settings:
`celery -A abplat worker` on a developer's machine sees what manage.py sees.
"""

import os

from celery import Celery, signals

from abplat.env import EnvError, load_env_file
from telemetry import logs

try:
    load_env_file(os.environ)
except EnvError as exc:
    raise SystemExit(f"abplat: configuration error: {exc}") from None
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

app = Celery("abplat")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.setup_logging.connect
def use_django_logging(**_kwargs) -> None:
    """Workers log through settings.LOGGING (ABPLAT_LOG_FORMAT, ABPLAT_LOG_LEVEL) like every
    other process: with a receiver here Celery leaves the root logger alone."""
    from django.conf import settings
    from django.utils.log import configure_logging

    configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)


_task_log_tokens: dict[str, object] = {}  # task id -> its log context token, while it runs


@signals.task_prerun.connect
def bind_task_id(task_id=None, **_kwargs) -> None:
    """Every line a task logs carries its ``task_id`` (telemetry/logs.py)."""
    if task_id:
        _task_log_tokens[task_id] = logs.bind(task_id=task_id)


@signals.task_postrun.connect
def unbind_task_id(task_id=None, **_kwargs) -> None:
    token = _task_log_tokens.pop(task_id, None)
    if token is not None:
        try:
            logs.reset(token)
        except ValueError:  # bound in another context (cannot happen in one thread): leave it
            pass


@app.on_after_configure.connect
def schedule_rollouts(sender, **_kwargs) -> None:
    """Celery beat's one entry: the rollout controller every ABPLAT_ROLLOUT_INTERVAL_S
    (rollouts/tasks.py). Unlike the spool flush it needs one run per interval, not one per
    host, and its lease (rollouts/service.py) keeps a second beat from deciding twice."""
    from django.conf import settings

    sender.add_periodic_task(
        float(settings.ROLLOUT_INTERVAL_S), sender.signature("rollouts.tasks.rollout_tick"), name="rollouts"
    )
