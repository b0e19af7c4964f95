"""Which simulator serves each variant of an experiment: on this host, on the port of the
variant's endpoint, with the model the variant asks for, and the profile named like the variant
(``fp16``, ``awq``, ``awq-fa2``; a key that names no profile gets the default one).

``manage.py simulator --experiment KEY`` serves them all from one process; ``make demo``
(workers/demo.py) starts one child process per variant by the same rule."""

from __future__ import annotations

import dataclasses
import urllib.parse

from simulator.profiles import DEFAULT, PROFILES

LOOPBACK = ("127.0.0.1", "localhost")


@dataclasses.dataclass(frozen=True)
class Served:
    variant: str
    profile: str
    port: int
    model: str


def served_variants(variants: list[dict]) -> list[Served]:
    """A ``Served`` per variant of an experiment document's ``variants``; ValueError naming the
    variant whose endpoint the simulator cannot serve (it listens on 127.0.0.1, plain http)."""
    served = []
    for i, variant in enumerate(variants):
        endpoint = variant["endpoint"]
        url = urllib.parse.urlsplit(endpoint)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme != "http" or url.hostname not in LOOPBACK or not port:
            raise ValueError(
                f"variants[{i}] ({variant['key']}): endpoint {endpoint} is not http://127.0.0.1:PORT/...: "
                "the simulator serves plain http on this host only"
            )
        profile = variant["key"] if variant["key"] in PROFILES else DEFAULT
        served.append(Served(variant["key"], profile, port, variant["model"]))
    ports = [s.port for s in served]
    if len(set(ports)) != len(ports):
        raise ValueError(f"two variants share a port: {ports}; one simulator serves one model per port")
    return served
