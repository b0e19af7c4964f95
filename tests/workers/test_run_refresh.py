"""A run followed by polling (replay --wait, a capacity step) refreshes its state without its
prompt plan: decoding megabytes of plan in the replaying process stalls its event loop."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from workers.models import ReplayRun


@pytest.mark.django_db
def test_a_refresh_reloads_the_state_but_not_the_plan_which_is_read_afresh_when_used(experiment):
    run = ReplayRun.objects.create(
        experiment=experiment, source="t.csv", total_requests=2, expected_samples=2
    )
    assert run.prompt_plan == {}
    plan = {"fp16": {str(seq): [300, 0, 307, False] for seq in range(2000)}}
    # what the replay task does while the command follows the run
    ReplayRun.objects.filter(pk=run.pk).update(
        prompt_plan=plan, status=ReplayRun.Status.RUNNING, samples_recorded=5
    )

    with CaptureQueriesContext(connection) as queries:
        run.refresh_from_db()
    assert (run.status, run.samples_recorded) == (ReplayRun.Status.RUNNING, 5)
    [select] = queries.captured_queries
    assert "prompt_plan" not in select["sql"]
    assert "prompt_plan" in run.get_deferred_fields()
    # used: read from the row then, never the stale empty plan the instance was created with
    with CaptureQueriesContext(connection) as queries:
        assert run.prompt_plan == plan
    assert len(queries.captured_queries) == 1 and "prompt_plan" in queries.captured_queries[0]["sql"]
    # asked for by name, it is refreshed as Django always did
    ReplayRun.objects.filter(pk=run.pk).update(prompt_plan={"awq": {}})
    run.refresh_from_db(fields=["prompt_plan"])
    assert run.prompt_plan == {"awq": {}}
