"""pytest plugin loaded first (pytest.ini: -p abplat.testing): a private ABPLAT_VAR per test
session, so tests never touch the developer's var/ (SQLite file, chDB, spool, weights)."""

import os
import tempfile

if "ABPLAT_VAR" not in os.environ:
    os.environ["ABPLAT_VAR"] = tempfile.mkdtemp(prefix="abplat-test-")
