#!/usr/bin/env bash
# Check every prerequisite of `make test` and print what is missing and how to provide it
# (scripts/doctor.py). Uses the project's virtualenv when there is one (real protocol checks of
# the services), else any python3 (TCP checks). Exit status 1 when something is missing.
#
#   scripts/doctor.sh [--only services|tools] [--create-databases]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$ROOT/.venv/bin/python" ]]; then
    exec "$ROOT/.venv/bin/python" "$ROOT/scripts/doctor.py" "$@"
fi
if ! command -v python3 >/dev/null; then
    echo "MISSING  python              no python3 on PATH: install Python 3.11 (apt-get install python3.11 python3.11-venv)" >&2
    exit 1
fi
exec python3 "$ROOT/scripts/doctor.py" "$@"
