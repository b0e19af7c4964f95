"""Whether a file's flock is held: how one process learns that another owns a file (the embedded
chDB's status file, a gateway's live-queue file, the host's recorder lock).

Pure: the standard library only.
"""

from __future__ import annotations

import fcntl
import os


def flock_held(path: str) -> bool:
    """Someone holds an flock on ``path`` (another open file, in this process or another). A
    missing file has no holder. The probe's own lock, when it got one, goes with its close."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
