from __future__ import annotations

import pytest

from experiments.engine_args import (
    ALLOWED,
    RISKY,
    EngineArgsError,
    check_engine_args,
    parse_allow_risky,
    render_engine_args,
    serve_argv,
)


def test_engine_args_render_to_sorted_kebab_flags():
    argv = render_engine_args(
        {
            "quantization": "awq",
            "max_model_len": 512,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.9,
            "compilation_config": {"level": 0},
            "cudagraph_capture_sizes": [1, 2],
            "seed": None,
        },
        allow_risky={"compilation_config"},
    )
    assert argv == [
        "--compilation-config",
        '{"level":0}',
        "--cudagraph-capture-sizes",
        "1",
        "2",
        "--no-enable-prefix-caching",  # false turns an on-by-default flag off, never dropped
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "512",
        "--quantization",
        "awq",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        ({"MaxLen": 1}, "snake_case"),
        ({"port": 1}, "set by the launcher"),
        ({"dtype": ""}, "empty string"),
        ({"gpu_memory_utilization": float("nan")}, "finite"),
        ({"cudagraph_capture_sizes": []}, "non-empty"),
        ({"seed": object()}, "unsupported value type"),
    ],
)
def test_bad_engine_args_name_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        render_engine_args(args)


def test_serve_argv_for_vllm_serve_and_for_the_python_module():
    assert serve_argv(["vllm", "serve"], "m", {}, host="h", port=1, served_model_name="n") == [
        "vllm",
        "serve",
        "m",
        "--host",
        "h",
        "--port",
        "1",
        "--served-model-name",
        "n",
    ]
    argv = serve_argv(["py", "-m", "api"], "m", {"dtype": "float32"}, host="h", port=2)
    assert argv == ["py", "-m", "api", "--model", "m", "--host", "h", "--port", "2", "--dtype", "float32"]
    with pytest.raises(ValueError, match="port"):
        serve_argv(["vllm", "serve"], "m", {}, host="h", port=0)


# Who may set which flag -------------------------------------------------------------------------


def test_the_performance_knobs_the_docs_and_demo_use_are_allowed():
    args = {
        "dtype": "float16",
        "quantization": "awq",
        "attention_backend": "FLASH_ATTN",
        "max_model_len": 4096,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 8192,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.9,
        "block_size": 16,
        "kv_cache_dtype": "fp8",
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "enforce_eager": True,
        "swap_space": 4,
        "seed": 0,
    }
    assert check_engine_args(args) == []
    assert "--attention-backend" in render_engine_args(args)


@pytest.mark.parametrize(
    "key, value",
    [
        ("worker_extension_cls", "evil.Extension"),  # imports a class on the serving host
        ("middleware", "evil.app"),
        ("logits_processors", ["evil.Processor"]),
        ("tool_parser_plugin", "/tmp/evil.py"),
        ("config", "/tmp/all-the-flags.yaml"),
        ("api_key", "k"),
        ("otlp_traces_endpoint", "http://collector.example"),
    ],
)
def test_a_flag_outside_the_allowlist_is_rejected_naming_it_and_the_allowlist(key, value):
    flag = "--" + key.replace("_", "-")
    [problem] = check_engine_args({key: value})
    assert problem.key == key
    assert flag in problem.message and "not an engine flag a variant may set" in problem.message
    assert "max-num-seqs" in problem.message and "trust-remote-code" in problem.message  # the lists
    # No operator option enables it: it is not a risky flag either.
    with pytest.raises(EngineArgsError, match=flag):
        render_engine_args({key: value}, allow_risky=RISKY)
    with pytest.raises(ValueError, match="not a risky engine flag"):
        parse_allow_risky([key.replace("_", "-")])


def test_a_risky_flag_is_served_only_when_the_operator_names_it():
    args = {"trust_remote_code": True, "dtype": "float16"}
    with pytest.raises(EngineArgsError) as info:
        serve_argv(["vllm", "serve"], "m", args, host="h", port=1)
    [problem] = info.value.problems
    assert problem.key == "trust_remote_code"
    assert "runs Python code shipped with the model" in problem.message
    assert "--allow-risky-engine-args trust-remote-code" in problem.message
    argv = serve_argv(["vllm", "serve"], "m", args, host="h", port=1, allow_risky={"trust_remote_code"})
    assert "--trust-remote-code" in argv
    # Allowing another risky flag does not allow this one.
    assert check_engine_args(args, allow_risky={"download_dir"})[0].key == "trust_remote_code"


def test_a_risky_flag_switched_off_needs_nobody():
    assert check_engine_args({"trust_remote_code": False, "download_dir": None}) == []


@pytest.mark.parametrize(
    "args",
    [
        {"cudagraph_capture_sizes": [8, "--trust-remote-code"]},  # argparse would read a flag
        {"quantization": "--trust-remote-code"},
        {"dtype": "-q"},
    ],
)
def test_a_value_that_argparse_would_read_as_a_flag_is_rejected(args):
    [problem] = check_engine_args(args)
    assert "may not start with '-'" in problem.message


def test_every_problem_is_reported_at_once():
    problems = check_engine_args({"api_key": "k", "trust_remote_code": True, "dtype": ""})
    assert [p.key for p in problems] == ["api_key", "dtype", "trust_remote_code"]


def test_the_operator_option_accepts_flag_spellings_and_rejects_typos():
    assert parse_allow_risky(["trust-remote-code,--download-dir", "tokenizer_revision"]) == {
        "trust_remote_code",
        "download_dir",
        "tokenizer_revision",
    }
    assert parse_allow_risky([""]) == frozenset()
    with pytest.raises(ValueError, match="--trust-remote-cod is not a risky engine flag"):
        parse_allow_risky(["trust-remote-cod"])
    with pytest.raises(ValueError, match="product users may set it without this option"):
        parse_allow_risky(["dtype"])


def test_the_lists_do_not_overlap_and_leave_the_launchers_flags_out():
    assert not ALLOWED & set(RISKY)
    assert not (ALLOWED | set(RISKY)) & {"host", "port", "model", "served_model_name"}
