"""What abplat tells its operators about itself: Prometheus metrics, structured logs, traces.

Imports no Django and no project code: web, workers and commands configure it at start
(docs/metrics.md, docs/deploy.md).
"""
