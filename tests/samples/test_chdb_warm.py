"""The embedded store (chDB) is warm for writing once a spooling writer is made over it: the
first sample batch of a fresh process loads no module (pyarrow's pandas layer and pandas came
with the writer, before any replay sends); a process that only opens the store to read loads
neither; and no code outside the backend has to know what to load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process (imports are once per process: this one has loaded everything already):
# open a store, then time and list what the first insert of a replay-like batch loads.
SCRIPT = """
import sys, tempfile
from samples import synthetic
from samples.backends.chdb import ChdbBackend
from samples.spool import SpoolingWriter

store = ChdbBackend(tempfile.mkdtemp(), "warm")
store.migrate()
store.query("SELECT count() FROM samples")
print("loaded by opening and reading:", sorted(m for m in ("pandas", "pyarrow.pandas_compat") if m in sys.modules))
SpoolingWriter(store, tempfile.mkdtemp())
assert "pyarrow" in sys.modules and "pandas" in sys.modules, "not loaded by making the writer"
spec = synthetic.SyntheticSpec(
    experiment="e", mode="split", n=300, seed=1, run_id=1,
    variants=[synthetic.VariantSpec("a", 50, {}, control=True), synthetic.VariantSpec("b", 50, {}, error_rate=0.2)],
)
cols = synthetic.generate(spec).columns
before = set(sys.modules)
assert store.insert_columns(cols) == len(cols["seq"])
print("loaded by the first insert:", sorted(set(sys.modules) - before))
assert store.query("SELECT count(), countIf(isNull(ttft_ms)) FROM samples")[0][1] > 0  # NULLs went in
"""


@pytest.mark.process
def test_the_first_insert_of_a_fresh_process_loads_nothing():
    got = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert "loaded by opening and reading: []" in got.stdout, got.stdout
    assert "loaded by the first insert: []" in got.stdout, got.stdout


def test_no_code_outside_the_backends_names_the_arrow_or_pandas_modules():
    pattern = re.compile(r"\b(import|from)\s+(pyarrow|pandas)\b|[\"'](pyarrow|pandas)[\"']")
    packages = (
        "abplat",
        "analysis",
        "capacity",
        "dashboards",
        "experiments",
        "gateway",
        "replay",
        "rollouts",
        "samples",
        "serving",
        "simulator",
        "stats",
        "streaming",
        "telemetry",
        "traces",
        "workers",
    )
    found = [
        str(p.relative_to(ROOT))
        for package in packages
        for p in (ROOT / package).rglob("*.py")
        if "backends" not in p.relative_to(ROOT).parts and pattern.search(p.read_text())
    ]
    assert found == []
