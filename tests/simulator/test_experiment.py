"""The simulator serves an experiment's variants (`manage.py simulator --experiment KEY`,
simulator/experiment.py), and a request for a model it does not serve says which one it does."""

from __future__ import annotations

import asyncio
import re
import socket

import httpx
import pytest
from django.core.management import CommandError, call_command

from simulator.experiment import Served, served_variants
from simulator.serve import serve_many, start_in_thread


def test_each_variant_is_served_on_its_port_with_its_model_and_the_profile_named_like_it(document):
    document["variants"][1]["key"] = "awq-v2"  # no profile of that name: the default one
    document["variants"][2]["model"] = "other-model"
    assert served_variants(document["variants"]) == [
        Served("fp16", "fp16", 8100, "tiny-llama"),
        Served("awq-v2", "default", 8101, "tiny-llama"),
        Served("awq-fa2", "awq-fa2", 8102, "other-model"),
    ]


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("http://gpu-7.internal:8000/v1", "not http://127.0.0.1:PORT"),
        ("https://127.0.0.1:8100/v1", "not http://127.0.0.1:PORT"),
        ("http://127.0.0.1/v1", "not http://127.0.0.1:PORT"),
        ("http://localhost:8100/v1", "share a port"),  # fp16 is on 8100 already
    ],
)
def test_an_endpoint_the_simulator_cannot_serve_is_named(document, endpoint, why):
    document["variants"][1]["endpoint"] = endpoint
    with pytest.raises(ValueError, match=why) as err:
        served_variants(document["variants"])
    if why.startswith("not"):
        assert str(err.value).startswith(f"variants[1] (awq): endpoint {endpoint} ")


@pytest.mark.django_db
def test_the_command_serves_the_experiments_variants(experiment, monkeypatch, capsys):
    served = {}

    def run_forever(endpoints, replicas, tokenizer, max_logprobs):
        served.update(endpoints=endpoints, replicas=replicas, tokenizer=tokenizer, max_logprobs=max_logprobs)

    monkeypatch.setattr("simulator.management.commands.simulator.run_forever", run_forever)
    call_command("simulator", "--experiment", experiment.key, "--replicas", "4")
    assert served == {
        "endpoints": [
            ("fp16", 8100, "tiny-llama"),
            ("awq", 8101, "tiny-llama"),
            ("awq-fa2", 8102, "tiny-llama"),
        ],
        "replicas": 4,
        "tokenizer": "bytes4",
        "max_logprobs": 20,
    }
    assert "ttft-opt: variant awq -> profile awq, model tiny-llama, port 8101" in capsys.readouterr().out


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["--experiment", "nope"], "no experiment 'nope'; `manage.py experiment list` lists them"),
        (["--experiment", "ttft-op"], "no experiment 'ttft-op'; did you mean 'ttft-opt'?"),
        (["--experiment", "ttft-opt", "--model", "m"], "--model with --experiment ttft-opt"),
        (["--experiment", "ttft-opt", "--serve", "fp16=9000"], "--serve with --experiment ttft-opt"),
        (["--experiment", "ttft-opt", "--replicas", "0"], "--replicas must be at least 1"),
    ],
)
def test_the_command_refuses_what_contradicts_the_experiment(experiment, args, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("simulator", *args)


def test_a_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            asyncio.run(serve_many([("fast", port, "tiny-llama")]))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_model_it_does_not_serve_is_a_404_naming_the_one_it_serves(path):
    sim = start_in_thread("fast", model="tiny-llama")
    try:
        body = {"model": "abplat-sim", "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(sim.url + path, json=body, trust_env=False, timeout=10)
    finally:
        sim.stop()
    assert reply.status_code == 404
    message = reply.json()["error"]["message"]
    assert message.startswith("The model `abplat-sim` does not exist.")  # vLLM's own sentence first
    assert "This simulator serves `tiny-llama`" in message and "--experiment KEY" in message
