from __future__ import annotations

import pytest

from serving.vllm_args import render_engine_args, serve_argv


def test_engine_args_render_to_sorted_kebab_flags():
    argv = render_engine_args(
        {
            "quantization": "awq",
            "max_model_len": 512,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.9,
            "compilation_config": {"level": 0},
            "allowed_origins": ["a", "b"],
            "seed": None,
        }
    )
    assert argv == [
        "--allowed-origins", "a", "b",
        "--compilation-config", '{"level":0}',
        "--enforce-eager",
        "--gpu-memory-utilization", "0.9",
        "--max-model-len", "512",
        "--quantization", "awq",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        ({"MaxLen": 1}, "snake_case"),
        ({"port": 1}, "set by the launcher"),
        ({"dtype": ""}, "empty string"),
        ({"x": float("nan")}, "finite"),
        ({"x": []}, "non-empty"),
        ({"x": object()}, "unsupported value type"),
    ],
)
def test_bad_engine_args_name_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        render_engine_args(args)


def test_serve_argv_for_vllm_serve_and_for_the_python_module():
    assert serve_argv(["vllm", "serve"], "m", {}, host="h", port=1, served_model_name="n") == [
        "vllm", "serve", "m", "--host", "h", "--port", "1", "--served-model-name", "n",
    ]  # fmt: skip
    argv = serve_argv(["py", "-m", "api"], "m", {"dtype": "float32"}, host="h", port=2)
    assert argv == ["py", "-m", "api", "--model", "m", "--host", "h", "--port", "2", "--dtype", "float32"]
    with pytest.raises(ValueError, match="port"):
        serve_argv(["vllm", "serve"], "m", {}, host="h", port=0)
