"""A replay started in a background thread, and waiting for what it does meanwhile."""

import io
import threading
import time

from django.core.management import call_command
from django.db import connections

TRACE = "data/traces/azure_llm_2023_code.csv"


def replay_in_thread(*args, key: str = "ttft-opt", trace: str = TRACE):
    """`manage.py replay KEY --trace TRACE *args` in a thread: (thread, its stdout, its errors)."""
    out, errors = io.StringIO(), []

    def work():
        try:
            call_command("replay", key, "--trace", trace, *args, stdout=out)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()  # this thread's connections, before the test database goes

    thread = threading.Thread(target=work)
    thread.start()
    return thread, out, errors


def wait_for(predicate, timeout: float = 60.0, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)
