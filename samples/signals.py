"""Signals the samples app sends about what reached the store.

Defined here, below both sides: workers sends them, dashboards connects the report's rollup build
(its AppConfig.ready), and neither imports the other.
"""

from __future__ import annotations

import django.dispatch

replay_finished = django.dispatch.Signal()
"""A replay run finished and every sample it recorded is stored (none left in the spool).

Sent once per run by the replay's finish step, with keyword arguments:
  sender      the sending class or module (receivers should not rely on it)
  run_id      int, the run's id: its samples carry this run_id
  experiment  str, the experiment's key
  store       the samples.store.SampleStore holding the samples (the one to build rollups in)
Receivers run synchronously in the sender's process; one that raises propagates to the sender
(use Signal.send_robust to collect errors instead).
"""
