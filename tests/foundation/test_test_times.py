"""scripts/test_times.py: the suite's time per directory and file from pytest's JUnit XML,
side by side with another run's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("test_times", ROOT / "scripts" / "test_times.py")
test_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_times)


def junit(path: Path, cases: list[tuple[str, str, float]]) -> Path:
    body = "".join(f'<testcase classname="{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'
    )
    return path


def test_times_add_up_per_file_and_directory_and_compare_with_another_run(tmp_path, capsys):
    now = junit(
        tmp_path / "now.xml",
        [
            ("tests.samples.test_spool", "test_a", 2.0),
            ("tests.samples.test_spool", "test_b[chdb]", 1.5),
            ("tests.samples.test_spool.TestGroup", "test_c", 0.5),
            ("tests.gateway.test_proxy", "test_d", 10.0),
        ],
    )
    old = junit(tmp_path / "old.xml", [("tests.samples.test_spool", "test_a", 1.0)])
    assert test_times.file_times(now) == {
        "tests/samples/test_spool.py": 4.0,
        "tests/gateway/test_proxy.py": 10.0,
    }
    assert test_times.main([str(now), "--against", str(old)]) == 0
    out = capsys.readouterr().out
    assert "2 files, 0.2 min of test time (against 0.0)" in out
    assert "| tests/gateway | 10.0 | 0.0 | +10.0 |" in out
    assert "| tests/samples/test_spool.py | 4.0 | 1.0 | +3.0 |" in out


def test_an_unreadable_file_says_which(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites>")
    with pytest.raises(SystemExit, match="cannot read .*bad.xml"):
        test_times.main([str(bad)])
