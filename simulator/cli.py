"""The simulator's command line, defined once: ``python -m simulator`` and
``python manage.py simulator`` (simulator/management/commands/simulator.py) both use it.

    --port P [--profile NAME] [--serve NAME=PORT ...] [--model NAME] [--replicas N]
    [--tokenizer bytes4|small-vocab] [--max-logprobs K]
"""

from __future__ import annotations

import argparse

from simulator.app import MAX_LOGPROBS
from simulator.logprobs import SUPPORT
from simulator.profiles import DEFAULT, PROFILES
from simulator.serve import DEFAULT_MODEL, parse_serve_pair, run_forever
from simulator.tokens import DEFAULT_TOKENIZER, TOKENIZERS

DESCRIPTION = (
    "Serve the vLLM-compatible simulator on 127.0.0.1: one profile on --port, and/or "
    "several profiles with repeated --serve NAME=PORT, all from this one process."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int)
    parser.add_argument("--profile", help=f"one of {', '.join(sorted(PROFILES))} (default {DEFAULT})")
    parser.add_argument("--serve", action="append", default=[], metavar="NAME=PORT")
    parser.add_argument("--model", help=f"served model name (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--replicas", type=int, default=1, help="engines behind each endpoint (least loaded first)"
    )
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default=DEFAULT_TOKENIZER,
        help=f"prompt-length rule for usage and /tokenize (simulator/tokens.py; default {DEFAULT_TOKENIZER})",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the largest prompt_logprobs a request may ask, as vLLM's flag (default {MAX_LOGPROBS})",
    )


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


def validated(options: dict) -> list[tuple[str, int]]:
    """The (profile, port) pairs to serve from parsed options; ValueError names what is wrong."""
    pairs = pairs_from_args(options["port"], options["profile"], options["serve"])
    if options["replicas"] < 1:
        raise ValueError(f"--replicas must be at least 1, got {options['replicas']}")
    check_max_logprobs(options.get("max_logprobs", MAX_LOGPROBS))
    return pairs


def check_max_logprobs(value: int) -> int:
    """``--max-logprobs`` if the simulated model can give that many, else ValueError saying why."""
    if not 0 <= value <= SUPPORT:
        raise ValueError(
            f"--max-logprobs {value}: must be within [0, {SUPPORT}], the tokens the simulated model generates"
        )
    return value


def serve(options: dict) -> None:
    """Serve until interrupted (Ctrl-C returns quietly); ValueError for bad options."""
    pairs = validated(options)
    try:
        run_forever(
            pairs,
            options["model"] or DEFAULT_MODEL,
            options["replicas"],
            options.get("tokenizer", DEFAULT_TOKENIZER),
            options.get("max_logprobs", MAX_LOGPROBS),
        )
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=DESCRIPTION)
    add_arguments(ap)
    options = vars(ap.parse_args(argv))
    try:
        validated(options)
    except ValueError as exc:
        ap.error(str(exc))
    serve(options)
    return 0
