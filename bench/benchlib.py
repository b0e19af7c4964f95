"""What every bench shares: a failed check ends the bench with one line and exit status 1.

A bench checks its preconditions (servers healthy, stores reachable) before it measures and its
results (outcomes ok, rows stored, counts exact) after, and raises BenchFailed naming what
failed and where: a table of failures is never printed as figures.
"""

from __future__ import annotations

import atexit
import pathlib
import subprocess
import sys
import tempfile
import traceback
import urllib.request
from collections.abc import Callable
from typing import Any


class BenchFailed(Exception):
    """A precondition or a result check failed: the figures would not mean what they say."""


def run_checked(run: Callable[..., Any], *args: Any) -> int:
    """Run a bench; exit status 0, or 1 with `bench FAILED: ...` on stderr."""
    try:
        return int(run(*args) or 0)
    except BenchFailed as exc:
        print(f"bench FAILED: {exc}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - a crash is a failed bench too; keep its traceback
        traceback.print_exc()
        print(f"bench FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return 1


def require_healthy(url: str, what: str, path: str = "/health") -> None:
    """Raise BenchFailed unless GET url+path answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(url + path, timeout=5) as r:
            if r.status == 200:
                return
            problem = f"HTTP {r.status}"
    except OSError as exc:
        problem = str(exc)
    raise BenchFailed(f"{what} at {url} not healthy: {problem}")


def checkout(ref: str, option: str) -> tuple[str, pathlib.Path]:
    """(short revision, directory): git revision ``ref`` of this repository checked out in a
    temporary worktree, removed when the bench exits, for a bench that runs another revision's
    code beside this tree's (``option``, e.g. "--against", names the flag in the error)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", ref], check=True, capture_output=True, text=True
        ).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise BenchFailed(
            f"{option} {ref!r}: not a revision of this repository: {exc.stderr.strip()}"
        ) from None
    tree = pathlib.Path(tempfile.mkdtemp(prefix=f"abplat-{rev}-"))
    done = subprocess.run(
        ["git", "-C", str(root), "worktree", "add", "--force", "--detach", str(tree), rev],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise BenchFailed(f"{option} {ref!r}: git worktree add failed: {done.stderr.strip()}")
    atexit.register(
        subprocess.run,
        ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
        capture_output=True,
    )
    return rev, tree
