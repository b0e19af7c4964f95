"""apply_experiment and export_experiment from the command line."""

import io
import json

import pytest
import yaml
from django.core.management import CommandError, call_command

from experiments.models import Experiment


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
@pytest.mark.engine
def test_apply_yaml_then_json_export_roundtrip(tmp_path, document):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(document))
    assert run("apply_experiment", str(path)).startswith("created ttft-opt")
    assert run("apply_experiment", str(path)).startswith("unchanged ttft-opt")
    exported = run("export_experiment", "ttft-opt", "--format", "json")
    (tmp_path / "exp.json").write_text(exported)
    assert run("apply_experiment", str(tmp_path / "exp.json")).startswith("unchanged")
    yaml_export = run("export_experiment", "ttft-opt")
    (tmp_path / "exp2.yaml").write_text(yaml_export)
    assert run("apply_experiment", str(tmp_path / "exp2.yaml")).startswith("unchanged")
    assert json.loads(exported)["variants"][2]["api"] == "completions"


@pytest.mark.django_db
@pytest.mark.engine
def test_apply_prints_changes(tmp_path, document):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(document))
    run("apply_experiment", str(path))
    document["hypothesis"] = "new"
    path.write_text(yaml.safe_dump(document))
    out = run("apply_experiment", str(path))
    assert "updated ttft-opt" in out and "hypothesis:" in out


@pytest.mark.django_db
def test_bad_document_exits_with_field_errors_and_writes_nothing(tmp_path, document):
    document["variants"][1]["weight"] = 90
    document["variants"][0]["endpoint"] = "nope"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(CommandError) as info:
        run("apply_experiment", str(path))
    message = str(info.value)
    assert "variants[0].endpoint" in message and "sum to 100" in message
    assert not Experiment.objects.exists()


@pytest.mark.django_db
def test_syntax_error_says_where(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("key: x\nvariants: [\n  - a\n")
    with pytest.raises(CommandError, match=r"invalid YAML at line \d+"):
        run("apply_experiment", str(path))
    path.write_text('{"key": "x",}')
    with pytest.raises(CommandError, match="invalid JSON at line 1"):
        run("apply_experiment", str(path))


@pytest.mark.django_db
def test_missing_file_and_unknown_experiment():
    with pytest.raises(CommandError, match="cannot read"):
        run("apply_experiment", "/nonexistent/x.yaml")
    with pytest.raises(CommandError, match="no experiment 'nope'"):
        run("export_experiment", "nope")


@pytest.mark.django_db
@pytest.mark.engine
def test_demo_document_applies(settings):
    from pathlib import Path

    demo = Path(settings.BASE_DIR) / "demo" / "ttft-optimizations.yaml"
    assert run("apply_experiment", str(demo)).startswith("created ttft-optimizations")
