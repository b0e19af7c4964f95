"""Live traffic records its samples through samples/ (samples.rows, the row builder the replay uses
too), never through the replay: the import contract in .importlinter says so (`make lint` runs
lint-imports), and the import graph keeps it."""

from __future__ import annotations

import configparser
from pathlib import Path

import grimp

CONFIG = Path(__file__).resolve().parents[2] / ".importlinter"


def _config() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    assert parser.read(CONFIG), CONFIG
    return parser


def _names(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_the_contract_forbids_the_gateway_to_import_the_replay():
    contracts = [
        section
        for name, section in _config().items()
        if name.startswith("importlinter:contract:") and section.get("type") == "forbidden"
    ]
    assert any(
        "gateway" in _names(c["source_modules"])
        and "replay" in _names(c["forbidden_modules"])
        and c.get("allow_indirect_imports", "false").lower() != "true"
        for c in contracts
    )


def test_no_module_of_the_gateway_reaches_the_replay_and_both_build_rows_with_samples_rows():
    graph = grimp.build_graph(*_names(_config()["importlinter"]["root_packages"]), cache_dir=None)
    assert graph.find_shortest_chains(importer="gateway", imported="replay", as_packages=True) == set()
    assert "samples.rows" in graph.find_modules_directly_imported_by("gateway.recorder_process")
    assert "samples.rows" in graph.find_modules_directly_imported_by("replay.runner")
    # the row builder is below both: it imports neither
    for above in ("replay", "gateway"):
        assert graph.find_shortest_chains(importer="samples", imported=above, as_packages=True) == set()
