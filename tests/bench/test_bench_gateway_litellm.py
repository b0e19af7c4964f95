"""bench/bench_gateway.py's LiteLLM peer: the pure helpers (--peers, the report of a re-encoded
stream, the headers cell) in-process, and scripts/litellm.sh's config (bash only: nothing is
installed or started)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_gateway_under_test", ROOT / "bench" / "bench_gateway.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


# The same completion as vLLM frames it (the last token and its finish reason in one event) and
# as LiteLLM re-encodes it (the finish reason and the usage each in an event of their own, whose
# choice has no text).
VLLM = sse(
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo", "finish_reason": None}]},
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " world", "finish_reason": "length"}]},
    {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "abplat": {}}},
)
LITELLM = sse(
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo"}]},
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " world"}]},
    {"id": "cmpl-1", "choices": [{"finish_reason": "length", "index": 0}]},
    {"id": "cmpl-1", "choices": [{"index": 0}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
)


def test_peers_are_known_names_once_each_in_a_fixed_order(bench):
    assert bench.parse_peers("nginx") == ("nginx",)
    assert bench.parse_peers(" LiteLLM, nginx,litellm ") == ("nginx", "litellm")
    assert bench.parse_peers("") == ()
    with pytest.raises(ValueError, match="unknown peer.*haproxy; known: nginx, litellm"):
        bench.parse_peers("nginx,haproxy")


def test_a_client_reads_the_same_text_finish_and_tokens_from_both_framings(bench):
    got, want = bench.stream_reading(LITELLM), bench.stream_reading(VLLM)
    assert got == {
        "text": " héllo world",
        "finish": ["length"],
        "completion_tokens": 2,
        "events": 5,
        "bare": 2,
    }
    assert want == {**got, "events": 4, "bare": 0}  # LiteLLM's finish and usage choices have no text
    assert bench.stream_reading(b'{"object": "error"}') is None  # not an SSE body


def test_a_re_encoded_stream_is_reported_with_what_a_client_reads(bench):
    line = bench.rewritten(LITELLM, VLLM)
    assert line.startswith(f"rewritten ({len(LITELLM)} vs {len(VLLM)} bytes, first difference at byte ")
    assert line.endswith(
        "; 5 vs 4 events): same text, finish reasons and token count; "
        "2 choice(s) with neither `text` nor `delta` (not OpenAI's schema)"
    )
    changed = LITELLM.replace(b" world", b" wor1d")
    assert "DIFFERENT text (' héllo wor1d' vs ' héllo world')" in bench.rewritten(changed, VLLM)
    cut = LITELLM.replace(b'"finish_reason": "length", ', b"")
    assert "DIFFERENT finish ([] vs ['length'])" in bench.rewritten(cut, VLLM)
    # An error body (JSON, not SSE): only its size and where it differs.
    assert bench.rewritten(b'{"error": {"code": "429"}}', b'{"object": "error"}') == (
        "rewritten (26 vs 19 bytes, first difference at byte 2)"
    )


def test_headers_cell_folds_a_family_of_three_or_more(bench):
    gateway = ["traceparent", "x-abplat-variant", "x-request-id"]
    assert bench.summarize_headers(gateway) == "traceparent, x-abplat-variant, x-request-id"
    lite = ["x-litellm-version", "vary", "x-litellm-call-id", "x-litellm-model-id", "x-frame-options"]
    assert bench.summarize_headers(lite) == "vary, x-frame-options, x-litellm-* (3)"
    assert bench.summarize_headers([]) == "-"


def litellm_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "litellm.sh"), *args], capture_output=True, text=True, timeout=30
    )


@pytest.mark.process
def test_litellm_config_routes_the_model_to_the_upstream_without_retries(tmp_path):
    done = litellm_sh("config", str(tmp_path / "w"), "4000", "http://127.0.0.1:8100/", "1", "abplat-sim")
    assert done.returncode == 0, done.stderr
    conf = pathlib.Path(done.stdout.strip())
    assert conf == tmp_path / "w" / "litellm.yaml"
    doc = yaml.safe_load(conf.read_text())
    assert doc["model_list"] == [
        {
            "model_name": "abplat-sim",
            "litellm_params": {
                "model": "openai/abplat-sim",
                "api_base": "http://127.0.0.1:8100/v1",
                "api_key": "none",
            },
        }
    ]
    assert doc["litellm_settings"]["num_retries"] == 0 and doc["router_settings"]["num_retries"] == 0
    assert "database_url" not in doc["general_settings"]  # no database: nothing to migrate or reach
    # host:port as nginx.sh takes it, and every model name when none is given
    doc = yaml.safe_load(
        pathlib.Path(
            litellm_sh("config", str(tmp_path / "x"), "4000", "127.0.0.1:8100").stdout.strip()
        ).read_text()
    )
    assert (
        doc["model_list"][0]["model_name"] == "*"
        and doc["model_list"][0]["litellm_params"]["model"] == "openai/*"
    )


@pytest.mark.process
@pytest.mark.parametrize(
    "args, message",
    [
        (["4000", "http://x"], "UPSTREAM 'http://x' must be host:port or http://host:port"),
        (["70000", "127.0.0.1:8100"], "PORT '70000' is not a port number"),
        (["4000", "127.0.0.1:8100", "0"], "WORKERS '0' must be a whole number >= 1"),
        (["4000", "127.0.0.1:8100", "1", "a b"], "MODEL 'a b' must be a model name"),
    ],
)
def test_litellm_config_refuses_bad_arguments(tmp_path, args, message):
    done = litellm_sh("config", str(tmp_path), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "litellm.yaml").exists()
