"""A run followed by polling (replay --wait, a capacity step) refreshes its state without its
prompt plan: decoding megabytes of plan in the replaying process stalls its event loop."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from workers.models import ReplayRun

pytestmark = pytest.mark.engine


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


@pytest.mark.django_db
def test_every_query_of_runs_leaves_the_plan_out_and_a_save_never_writes_a_plan_it_did_not_read(experiment):
    plan = {"fp16": {str(seq): [300, 0, 307, False] for seq in range(50)}}
    created = ReplayRun.objects.create(
        experiment=experiment, source="t.csv", total_requests=2, prompt_plan=plan
    )
    with CaptureQueriesContext(connection) as queries:
        listed = list(ReplayRun.objects.select_related("experiment").filter(experiment=experiment))
        got = ReplayRun.objects.get(pk=created.pk)
    assert [r.pk for r in listed] == [created.pk]
    assert all("prompt_plan" not in q["sql"] for q in queries.captured_queries)
    # the replay task writes a fresh plan after this copy was loaded; saving the copy keeps it
    newer = {"awq": {"0": [1, 0, 1, False]}}
    ReplayRun.objects.filter(pk=created.pk).update(prompt_plan=newer)
    got.status = ReplayRun.Status.RUNNING
    got.save()
    again = ReplayRun.objects.get(pk=created.pk)
    assert again.status == ReplayRun.Status.RUNNING and again.prompt_plan == newer


@pytest.mark.django_db
def test_the_admin_summarises_the_plan_instead_of_rendering_it(experiment, users, client):
    plan = {"fp16": {str(seq): [300, 0, 307, False] for seq in range(1200)}, "awq": {"0": [3, 0, 3, False]}}
    run = ReplayRun.objects.create(experiment=experiment, source="t.csv", total_requests=2, prompt_plan=plan)
    client.force_login(users["admin"])
    page = client.get(f"/admin/workers/replayrun/{run.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "awq: 1 prompts; fp16: 1,200 prompts" in html
    assert "[300, 0, 307, false]" not in html
