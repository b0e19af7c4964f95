"""Signals other apps listen to, so that experiments never imports them.

``experiment_transitioned`` is sent inside the lifecycle move's transaction, after the status
changed and the weights store heard of it, with keyword arguments:

- ``experiment``: the Experiment, refreshed (its new status);
- ``action``: the lifecycle action ("start", "pause", "resume", "conclude");
- ``before``, ``after``: the statuses before and after;
- ``actor``: the user who moved it (or None).

Receivers run in that transaction: one that raises rolls the move back, so the experiment is
never left half-moved (e.g. concluded while its replays keep sending).
"""

from django.dispatch import Signal

experiment_transitioned = Signal()
