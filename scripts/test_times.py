"""Where the suite's time goes: per directory and per file, from the JUnit XML of a pytest run.

    .venv/bin/python scripts/test_times.py var/test-times/sqlite.xml [--top 25]
    .venv/bin/python scripts/test_times.py var/test-times/sqlite.xml --against OLD.xml

`make test` writes var/test-times/sqlite.xml and postgres.xml (its two passes). The time of a
file is the sum of its tests' times as pytest reports them (set-up, call and tear-down), so a
module fixture shows in the file of the test that first needed it. With --against, each row
also shows the other run's time and the difference: what a change cost or saved.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def file_times(path: Path) -> dict[str, float]:
    """{test file: seconds} of one JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise SystemExit(f"test_times: cannot read {path}: {exc}") from None
    out: collections.Counter[str] = collections.Counter()
    for case in root.iter("testcase"):
        name = case.get("classname", "")
        module = name.split(".")
        # "tests.samples.test_spool" or "tests.samples.test_spool.TestClass"
        while module and not module[-1].startswith("test_"):
            module.pop()
        key = "/".join(module) + ".py" if module else name
        out[key] += float(case.get("time") or 0.0)
    return dict(out)


def table(rows: list[tuple[str, float, float | None]], title: str) -> list[str]:
    lines = [f"| {title} | seconds | against | difference |", "| --- | ---: | ---: | ---: |"]
    for name, t, old in rows:
        other = "" if old is None else f"{old:.1f}"
        diff = "" if old is None else f"{t - old:+.1f}"
        lines.append(f"| {name} | {t:.1f} | {other} | {diff} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("xml", type=Path)
    parser.add_argument("--against", type=Path, help="another run's JUnit XML, side by side")
    parser.add_argument("--top", type=int, default=25, help="files shown (default 25)")
    args = parser.parse_args(argv)
    now = file_times(args.xml)
    old = file_times(args.against) if args.against else None
    dirs: collections.Counter[str] = collections.Counter()
    old_dirs: collections.Counter[str] = collections.Counter()
    for name, t in now.items():
        dirs[str(Path(name).parent)] += t
    for name, t in (old or {}).items():
        old_dirs[str(Path(name).parent)] += t
    total, old_total = sum(now.values()), sum((old or {}).values())
    print(
        f"{len(now)} files, {total / 60:.1f} min of test time"
        + (f" (against {old_total / 60:.1f})" if old else "")
    )
    print()
    by_dir = sorted(dirs.items(), key=lambda kv: -kv[1])
    print("\n".join(table([(d, t, old_dirs.get(d, 0.0) if old else None) for d, t in by_dir], "directory")))
    print()
    by_file = sorted(now.items(), key=lambda kv: -kv[1])[: args.top]
    print("\n".join(table([(f, t, (old or {}).get(f, 0.0) if old else None) for f, t in by_file], "file")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
