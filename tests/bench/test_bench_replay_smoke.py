"""bench/bench_replay.py --quick end to end, so the benchmark cannot rot unnoticed.

Needs the ClickHouse server (scripts/clickhouse.sh start); the bench exits with that hint when
the server is down, and the assertion message shows it. No timing is asserted: only that every
table prints and that the store holds exactly one sample per request.
"""

import pathlib
import subprocess
import sys

from tests.plugin import server_url_for

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_bench_prints_every_table_with_exact_sample_counts():
    url = server_url_for("abplat_bench_smoke")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_replay.py"), "--quick", "--clickhouse-url", url],
        cwd=ROOT, capture_output=True, text=True, timeout=90,  # a hang guard, not a timing check
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{out}\n{proc.stderr}"
    assert "2 cores" in out or "cores" in out.splitlines()[0]
    assert "| run | workers | target/s |" in out
    for label in ("| floor | 1 | 50 | 50 |", "| no network | 1 | 50 | 50 |", "| real | 1 | 50 | 50 |",
                  "| real | 2 | 50 | 50 |", "| real, prompts prebuilt | 1 | 50 | 50 |"):  # fmt: skip
        assert label in out, f"missing part 1 row {label!r}:\n{out}"
    assert "highest sustained rate" in out
    # Part 2: the trace's first 60 requests, one sample each (split) and three each (mirror),
    # counted in the store with uniqExact and FINAL and matching the raw row count.
    assert "| split | fast | 60 | 100x |" in out and "| 60 | 60 | 60 | 60 | yes |" in out, out
    assert "| mirror | fast | 60 | 100x |" in out and "| 180 | 180 | 180 | 180 | yes |" in out, out
