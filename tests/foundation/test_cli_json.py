"""--json on the management commands (experiments.cli): one JSON document on stdout with the
real values, and on failure {"error": {"message", "field", "errors"}} with a non-zero exit.
The replay, rollup and flush commands: tests/workers/test_replay_cli.py."""

import functools
import io

import pytest
import yaml
from django.core.management import call_command

from experiments import services
from experiments.models import AuditEntry, Experiment
from experiments.weights.publish import current_weights
from tests.cli import as_json, command_line, failing, own_env
from tests.workers.background import manage
from traces.models import Trace


@pytest.fixture
def started(experiment, users):
    services.transition(experiment, "start", users["product"])
    return experiment


@pytest.mark.django_db
@pytest.mark.engine
def test_set_weights_json_reports_the_revision_written_and_the_users_moved(started, users):
    _, revision = current_weights("ttft-opt")
    dry = as_json("set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=20", "--reason", "x", "--dry-run")
    assert (dry["dry_run"], dry["changed"], dry["revision"]) == (True, False, revision)
    assert current_weights("ttft-opt")[1] == revision  # a dry run writes nothing

    doc = as_json(
        "set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=20", "--reason", "ramp", "--as", "sam"
    )
    now, stored_revision = current_weights("ttft-opt")
    assert doc["changed"] is True and doc["unchanged"] is False
    assert (doc["previous_revision"], doc["revision"]) == (
        revision,
        stored_revision,
    ) and stored_revision > revision
    assert doc["previous_weights"] == {"fp16": 34, "awq": 33, "awq-fa2": 33}
    assert doc["weights"] == dict(now.weights) == {"fp16": 50, "awq": 30, "awq-fa2": 20}
    assert doc["moved_share"] == dry["moved_share"] == doc["moved_buckets"] / doc["n_buckets"]
    assert doc["minimum_share"] == pytest.approx(0.16)  # total variation: 16 points move at least
    assert doc["moved_share"] >= doc["minimum_share"] and doc["moved"].startswith(f"{doc['moved_share']:.2%}")
    entry = AuditEntry.objects.filter(action="set_weights").first()
    assert (entry.actor_name, entry.reason) == ("sam", "ramp")

    again = as_json("set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=20", "--reason", "noop")
    assert (again["changed"], again["unchanged"], again["revision"]) == (False, True, stored_revision)


@pytest.mark.django_db
@pytest.mark.engine
def test_set_weights_json_errors_name_the_fields_and_change_nothing(started):
    _, revision = current_weights("ttft-opt")
    exc, doc = failing("set_weights", "ttft-opt", "fp16=50", "awq=30", "awq-fa2=30", "--reason", "x")
    assert doc["error"]["message"] == str(exc) and "nothing changed" in str(exc)
    assert doc["error"]["errors"] and doc["error"]["field"] == doc["error"]["errors"][0]["field"]
    assert any("100" in e["message"] for e in doc["error"]["errors"])
    _, doc = failing("set_weights", "ttft-opt", "fp16=half", "--reason", "x")
    assert doc["error"]["field"] == "weights"
    assert doc["error"]["errors"] == [
        {"field": "weights", "message": "'fp16=half': weight must be an integer percent, got 'half'"}
    ]
    _, doc = failing(
        "set_weights", "ttft-opt", "fp16=50", "awq=50", "awq-fa2=0", "--reason", "x", "--as", "eve"
    )
    assert doc["error"] == {"message": "--as: no user named 'eve'", "field": "--as", "errors": []}
    _, doc = failing(
        "set_weights",
        "ttft-opt",
        "fp16=50",
        "awq=50",
        "awq-fa2=0",
        "--reason",
        "x",
        "--expected-revision",
        str(revision + 5),
    )
    assert doc["error"]["field"] == "--expected-revision" and doc["current_revision"] == revision
    assert current_weights("ttft-opt")[1] == revision


@pytest.mark.django_db
def test_assign_json_summarizes_exactly_the_assignments_it_would_print(started, tmp_path):
    users_in = [f"user-{i}" for i in range(500)]
    lines = "\n".join(users_in[:250]) + "\n\n\n" + "\n".join(users_in[250:]) + "\n"
    plain = io.StringIO()
    call_command("assign", "ttft-opt", stdin=io.StringIO(lines), stdout=plain, stderr=io.StringIO())
    expected = {}
    for row in plain.getvalue().splitlines():
        expected[row.split("\t")[1]] = expected.get(row.split("\t")[1], 0) + 1
    doc = as_json("assign", "ttft-opt", stdin=io.StringIO(lines))
    _, revision = current_weights("ttft-opt")
    assert doc == {
        "experiment": "ttft-opt",
        "revision": revision,
        "hash_version": 1,
        "weights": {"fp16": 34, "awq": 33, "awq-fa2": 33},
        "users": 500,
        "by_variant": {v: expected.get(v, 0) for v in ("fp16", "awq", "awq-fa2")},
        "skipped_empty_lines": 2,
        "output": None,
    }
    assert all(n > 100 for n in doc["by_variant"].values())  # 500 users over 34/33/33
    # --output: the assignments go to the file, the summary to stdout
    target = tmp_path / "assignments.tsv"
    doc = as_json("assign", "ttft-opt", "--output", str(target), stdin=io.StringIO(lines))
    assert target.read_text() == plain.getvalue() and doc["output"] == str(target)
    _, doc = failing(
        "assign", "ttft-opt", "--output", str(tmp_path / "no" / "dir.tsv"), stdin=io.StringIO("u\n")
    )
    assert doc["error"]["field"] == "--output" and "cannot write" in doc["error"]["message"]


@pytest.mark.django_db
def test_assign_json_on_a_draft_says_why(experiment):
    _, doc = failing("assign", "ttft-opt", stdin=io.StringIO("u1\n"))
    assert doc["error"]["field"] == "key" and "draft" in doc["error"]["message"]


@pytest.mark.django_db
@pytest.mark.engine
def test_apply_and_export_json(tmp_path, document):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(document))
    assert as_json("apply_experiment", str(path)) == {
        "experiment": "ttft-opt",
        "result": "created",
        "changes": ["created with variants fp16, awq, awq-fa2"],
    }
    assert as_json("apply_experiment", str(path)) == {
        "experiment": "ttft-opt",
        "result": "unchanged",
        "changes": [],
    }
    document["hypothesis"] = "sharper"
    path.write_text(yaml.safe_dump(document))
    updated = as_json("apply_experiment", str(path))
    assert updated["result"] == "updated" and updated["changes"] == [
        "hypothesis: 'AWQ + FlashAttention-2 keeps 99.2% of first tokens under 200 ms' -> 'sharper'"
    ]
    exported = as_json("export_experiment", "ttft-opt")
    assert exported == services.export_document(Experiment.objects.get(key="ttft-opt"))
    assert exported["hypothesis"] == "sharper"
    _, doc = failing("export_experiment", "nope")
    assert doc["error"] == {
        "message": "no experiment 'nope'; `manage.py experiment list` lists them",
        "field": "key",
        "errors": [],
    }
    _, doc = failing("export_experiment", "ttft-opt", "--format", "yaml")
    assert doc["error"]["field"] == "--format"


@pytest.mark.django_db
def test_a_rejected_document_lists_every_field_error(tmp_path, document):
    document["variants"][1]["weight"] = 90
    document["variants"][0]["endpoint"] = "nope"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    exc, doc = failing("apply_experiment", str(path))
    fields = [e["field"] for e in doc["error"]["errors"]]
    assert "variants[0].endpoint" in fields and "variants" in fields
    assert all(e["message"] and e["message"] in str(exc) for e in doc["error"]["errors"])
    assert doc["error"]["field"] == fields[0] and not Experiment.objects.exists()


@pytest.mark.django_db
def test_sla_report_json_error_names_the_experiment(db):
    _, doc = failing("sla_report", "nope")
    message = "no experiment 'nope'; there are none yet: `manage.py apply_experiment FILE` makes one"
    assert doc == {"error": {"message": message, "field": "key", "errors": []}}


@pytest.mark.process
def test_on_the_real_command_line_stdout_is_one_document_and_the_exit_code_says_how_it_went(
    tmp_path, document
):
    """Exit 0 with the result, 1 with a refusal, 2 with a command line argparse rejects: each
    with one JSON document on stdout and the human message on stderr."""
    env = own_env(tmp_path)
    manage(env, "migrate", "-v0")
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(document))
    manage(env, "apply_experiment", str(tmp_path / "exp.yaml"))
    command = functools.partial(command_line, env)

    code, doc, _ = command("experiment", "start", "ttft-opt", "--json")
    assert code == 0 and doc["transition"]["to"] == "running"
    code, doc, err = command("experiment", "start", "ttft-opt", "--json")
    assert code == 1 and doc["error"]["field"] == "action" and doc["status"] == "running"
    assert doc["error"]["message"] in err  # the person reading the terminal sees it too
    code, doc, err = command("set_weights", "ttft-opt", "fp16=100", "--json")
    assert code == 2 and "usage:" in err
    assert doc["error"] == {
        "message": "the following arguments are required: --reason",
        "field": "--reason",
        "errors": [],
    }
    code, doc, _ = command("experiment", "show", "ttft-opt", "--json", "--bogus")
    assert code == 2 and doc["error"]["message"] == "unrecognized arguments: --bogus"
    code, doc, _ = command("experiment", "list", "--status", "maybe", "--json")
    assert (
        code == 2
        and doc["error"]["field"] == "--status"
        and "invalid choice: 'maybe'" in doc["error"]["message"]
    )


@pytest.mark.django_db
@pytest.mark.engine
def test_add_trace_json_lists_the_stored_trace(settings, tmp_path):
    settings.TRACE_DIR = tmp_path / "traces"
    local = tmp_path / "local.csv"
    local.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.6805900,396,109\n"
    )
    doc = as_json("add_trace", str(local))
    stored = Trace.objects.get()
    assert doc == {
        "name": "local.csv",
        "created": True,
        "rows": 2,
        "span_s": 4.0,
        "rate": 0.5,
        "format": "azure",
        "size": local.stat().st_size,
        "sha256": stored.sha256,
    }
    assert as_json("add_trace", str(local), "--name", "again")["created"] is False
    _, doc = failing("add_trace", str(tmp_path / "missing.csv"))
    assert doc["error"]["field"] == "path"
    _, doc = failing("add_trace", str(local), "--name", "a" * 64)
    assert doc["error"]["field"] == "--name" and "sha256" in doc["error"]["message"]
