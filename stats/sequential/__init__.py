"""Anytime-valid statistics for rollouts: read them after every batch, stop whenever.

A fixed-horizon interval (stats.proportions, stats.comparisons) is valid at one sample size
chosen in advance; a controller that looks after every batch and acts on the first look that
crosses a line makes far more errors than its alpha says. The sequences here hold at every
sample size at once: with probability at least 1 - alpha they contain the truth at all looks
together, so a decision taken at any look, however many looks, keeps its error rate.

Split by kind; import from the module that defines a name:
- ``means``: confidence sequences for a share (SLA attainment, error rate) and for the
  difference of two arms' shares;
- ``quantiles``: confidence sequences for a quantile (p99 TTFT), per arm and for the
  difference, from a streaming histogram or sorted values;
- ``srm``: the sequential sample ratio mismatch test (an e-value and an anytime p-value);
- ``guardrails``: the rollout decision (breach, halt, pass, undecided) from guardrails as the
  document states them (``guardrail_spec``), reading each arm's ``arm_snapshot`` (totals,
  latencies, per-user aggregates, the candidate's shadowed answers), the shares through
  ``share_reading`` (exact, user-clustered or adjusted) and the candidate's setup errors
  through ``setup_errors``;
- ``adjusted``: asymptotic confidence sequences for the user-clustered mean and difference of
  means and the covariate-adjusted difference (normal mixture on the robust variance).

This package module imports nothing.
"""
