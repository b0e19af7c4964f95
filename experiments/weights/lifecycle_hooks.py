"""What the weights store hears of the experiment lifecycle.

Starting an experiment publishes its first weights document (the variants' weights as the
product team set them), so routers begin assigning users; from then on only SREs change
weights. Concluding removes the document, so routers stop assigning (callers serve their
default). Pausing keeps the weights: users keep their variant, only replays stop. Runs inside
the transition's transaction: if the store write fails, the status change rolls back and the
experiment stays where it was.
"""

from __future__ import annotations


def after_transition(experiment, action: str, actor) -> None:
    from experiments.weights.publish import publish_weights, retire_weights

    if action == "conclude":
        retire_weights(experiment, actor, reason="experiment concluded")
        return
    if action != "start":
        return

    publish_weights(
        experiment,
        {v.key: v.weight for v in experiment.variants.all()},
        actor=actor,
        reason="experiment started",
        expected_revision=None,
    )
