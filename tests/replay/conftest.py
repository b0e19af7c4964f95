"""Replay fixtures: simulated variants and a running experiment pointed at them."""

import pytest

from experiments import services
from simulator.serve import start_in_thread

TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.fixture(scope="module")
def sims():
    """Three fast simulators (in threads of this process) standing in for the demo's variants."""
    handles = {name: start_in_thread("fast", model="tiny-llama") for name in ("fp16", "awq", "awq-fa2")}
    yield handles
    for h in handles.values():
        h.stop()


@pytest.fixture
def running(db, document, sims, users):
    """The test document's experiment, its variants on the simulators, started (weights published)."""
    for v in document["variants"]:
        v["endpoint"] = sims[v["key"]].url + "/v1"
        v["api"] = "chat"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment
