"""python -m simulator --port P [--profile NAME] [--serve NAME=PORT ...] [--model NAME] [--replicas N]"""

from __future__ import annotations

import argparse
import sys

from simulator.profiles import DEFAULT, PROFILES
from simulator.serve import DEFAULT_MODEL, parse_serve_pair, run_forever


def pairs_from_args(port: int | None, profile: str | None, serve: list[str]) -> list[tuple[str, int]]:
    pairs = [parse_serve_pair(s) for s in serve]
    if port is not None:
        pairs.insert(0, parse_serve_pair(f"{profile or DEFAULT}={port}"))
    elif profile:
        raise ValueError("--profile needs --port (or use --serve NAME=PORT)")
    if not pairs:
        raise ValueError("give --port P [--profile NAME] and/or --serve NAME=PORT")
    ports = [p for _, p in pairs]
    if len(set(ports)) != len(ports):
        raise ValueError(f"a port is used twice: {ports}")
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    ap.add_argument("--port", type=int)
    ap.add_argument("--profile", help=f"one of {', '.join(sorted(PROFILES))} (default {DEFAULT})")
    ap.add_argument("--serve", action="append", default=[], metavar="NAME=PORT")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    ap.add_argument(
        "--replicas", type=int, default=1, help="engines behind each endpoint (least loaded first)"
    )
    args = ap.parse_args(argv)
    try:
        pairs = pairs_from_args(args.port, args.profile, args.serve)
    except ValueError as exc:
        ap.error(str(exc))
    if args.replicas < 1:
        ap.error(f"--replicas must be at least 1, got {args.replicas}")
    try:
        run_forever(pairs, args.model, args.replicas)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
