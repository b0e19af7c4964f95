"""The gateway sends a variant's secret only where the operator's binding lets it go
(``_bindings.json`` in ABPLAT_VARIANT_SECRETS_DIR): a binding narrowed after the document was
saved takes effect at the next refresh of the variants, and a request routed there is answered
with an error, recorded, and never reaches the host with the token."""

from __future__ import annotations

import json

import openai
import pytest

from experiments.weights import process
from streaming.result import Outcome
from tests.gateway.conftest import user_on

pytestmark = pytest.mark.django_db(transaction=False)

TOKEN = "sk-gateway-bound-0123456789"
MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def _bind(directory, hosts) -> None:
    (directory / "_bindings.json").write_text(
        json.dumps({"vllm-key": {"hosts": hosts, "teams": ["default"]}})
    )


def test_the_gateway_sends_a_bound_secret_and_refuses_a_host_its_binding_left(
    recording_sim, running_with, make_gateway, settings, tmp_path
):
    sim, seen = recording_sim
    directory = tmp_path / "secrets"
    directory.mkdir()
    (directory / "vllm-key").write_text(TOKEN + "\n")
    _bind(directory, ["127.0.0.1"])
    settings.VARIANT_SECRETS_DIR = str(directory)

    def on_the_sim(doc):
        for v in doc["variants"]:
            v["endpoint"] = sim.url + "/v1"
        doc["variants"][0]["auth"] = {"secret": "vllm-key"}

    running_with(on_the_sim)
    gw = make_gateway()
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    client = gw.client()
    assert client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user=user, max_tokens=4)
    assert seen == [("/v1/chat/completions", f"Bearer {TOKEN}")]

    _bind(directory, ["localhost"])  # the operator narrows the binding
    gw.gateway.directory.refresh()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user=user, max_tokens=4)
    assert info.value.status_code == 502
    # The tenant learns the request id, not the operator's secret names or bindings.
    request_id = info.value.response.headers["x-request-id"]
    assert request_id in info.value.message and "vllm-key" not in info.value.message
    assert "bound" not in info.value.message and TOKEN not in info.value.message
    assert len(seen) == 1  # the refused request never left the gateway
    records = gw.recorder.wait_for(2)
    assert [r["result"].outcome for r in records] == [Outcome.OK, Outcome.CLIENT_ERROR]
    assert "not bound to host '127.0.0.1'" in records[1]["result"].error  # the operator's side has it
    assert records[1]["request_id"] == request_id
