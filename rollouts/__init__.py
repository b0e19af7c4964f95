"""Progressive rollouts: the controller that steps an experiment's candidate up
through the plan in its document's ``rollout:`` block, promotes on passing guardrails and rolls
back on a breach. ``controller`` is the pure decision; ``service`` the glue that reads the
stores, takes the lease and writes the weights."""
