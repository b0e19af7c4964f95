"""Statistics for the SLA report: pure numpy/scipy, no Django, no ClickHouse.

Split by kind; import from the module that defines a name:
- ``proportions``: the Wilson interval (one implementation), SLA attainment, ``meets_slos``;
- ``quantiles``: the one quantile convention (``nearest_rank``, ``quantile_rank``), order
  statistic CIs, quantile plans and estimates (stdlib-only at import time);
- ``comparisons``: variant-vs-control differences, Mann-Whitney, Holm;
- ``paired``: mirror mode (McNemar, Wilcoxon signed-rank);
- ``srm``: sample ratio mismatch;
- ``verdict``: the SLA verdict and the sample size to reach one;
- ``clustered``: means and differences with users, the unit of randomization, as the
  independent unit (delta method over per-user sums), beside the per-request figures;
- ``adjusted``: the difference adjusted on pre-request covariates (prompt tokens, requested
  output tokens), user-clustered, from per-user sums;
- ``sequential``: anytime-valid statistics for rollouts (confidence sequences, the sequential
  SRM test, guardrail decisions), the ones that may be read after every batch.

The API is shaped around what ClickHouse returns, so only aggregates travel to Python.
Every result is a frozen dataclass with ``as_dict()`` giving JSON-safe values (no NaN).
This package module imports nothing, so ``stats.quantiles`` stays light.
"""
