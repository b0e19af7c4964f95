"""python -m simulator: the command line of simulator/cli.py."""

import sys

from simulator.cli import main

if __name__ == "__main__":
    sys.exit(main())
