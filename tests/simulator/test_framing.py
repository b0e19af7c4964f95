"""The simulator's bytes against real vLLM 0.32 captures (tests/data/vllm-captures/)."""

from __future__ import annotations

import json
import pathlib
import re

import httpx
import pytest

from simulator.framing import DONE, ENGINE_ERROR
from simulator.serve import start_in_thread

CAPTURES = pathlib.Path(__file__).parents[1] / "data" / "vllm-captures"
MODEL = "/tmp/vllmprobe/tiny-llama"  # the model path the captures were taken with


def normalise(raw: bytes) -> bytes:
    """Blank out what legitimately differs per run: token text, clock, counts, build hash."""
    s = raw.decode()
    s = re.sub(r',"abplat":\{[^}]*\}', "", s)  # our ground truth, absent from real vLLM
    s = re.sub(r'"(content|text)":"(?:[^"\\]|\\.)*"', r'"\1":"T"', s)
    s = re.sub(r'"created":\d+', '"created":0', s)
    s = re.sub(r'"(prompt_tokens|total_tokens|completion_tokens)":\d+', r'"\1":0', s)
    s = re.sub(r'"system_fingerprint":"[^"]*"', '"system_fingerprint":"X"', s)
    return s.encode()


@pytest.fixture(scope="module")
def sim():
    handle = start_in_thread("default", model=MODEL)
    yield handle
    handle.stop()


def fetch(sim, path: str, body: dict, request_id: str) -> bytes:
    with httpx.Client(base_url=sim.url, timeout=10, trust_env=False) as c:
        r = c.post(path, json=body, headers={"x-request-id": request_id})
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        return r.content


def test_chat_stream_is_byte_identical_to_vllm_apart_from_text_and_counts(sim):
    capture = (CAPTURES / "sse_chat.txt").read_bytes()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = fetch(sim, "/v1/chat/completions", body, "84b019685374fac5")
    assert normalise(got) == normalise(capture)


def test_completion_stream_is_byte_identical_to_vllm_apart_from_text_and_counts(sim):
    capture = (CAPTURES / "sse_completion.txt").read_bytes()
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = fetch(sim, "/v1/completions", body, "be03dde6e03e0d6c")
    assert normalise(got) == normalise(capture)


def test_engine_error_bytes_are_exactly_vllms():
    assert ENGINE_ERROR + DONE == (CAPTURES / "sse_chat_engine_error.txt").read_bytes()


def test_usage_event_carries_ground_truth_and_is_absent_without_include_usage(sim):
    base = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with_usage = fetch(sim, "/v1/completions", {**base, "stream_options": {"include_usage": True}}, "u1")
    events = [e[6:] for e in with_usage.decode().split("\n\n") if e.startswith("data: {")]
    truth = json.loads(events[-1])["usage"]["abplat"]
    assert truth["server_ttft_ms"] > 0 and truth["first_content_ns"] > truth["received_ns"]
    without = fetch(sim, "/v1/completions", base, "u2")
    assert b'"usage"' not in without and without.endswith(DONE)
