"""Render a variant's ``engine_args`` to a ``vllm serve`` command line. Pure.

Rules, following vLLM's argparse conventions: a key ``max_model_len`` becomes
``--max-model-len``; ``True`` is a bare flag, ``False`` and ``None`` are left out (vLLM's
defaults), a list repeats its values after one flag, a dict is passed as compact JSON (vLLM's
JSON-valued options such as ``--compilation-config``). Host, port and model belong to the
launcher, not to the variant, so engine_args may not set them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED = ("host", "port", "model", "served_model_name")


def render_engine_args(engine_args: Mapping[str, Any]) -> list[str]:
    if not isinstance(engine_args, Mapping):
        raise ValueError(f"engine_args: expected an object, got {type(engine_args).__name__}")
    argv: list[str] = []
    for key in sorted(engine_args):  # sorted: the same args always give the same command
        value = engine_args[key]
        where = f"engine_args.{key}"
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"engine_args key {key!r}: use snake_case names like max_model_len")
        if key in RESERVED:
            raise ValueError(f"{where}: set by the launcher (--host/--port/--model), not here")
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{where}={value!r}: must be a finite number")
            argv += [flag, str(value)]
        elif isinstance(value, str):
            if not value:
                raise ValueError(f"{where}: empty string; leave the key out for vLLM's default")
            argv += [flag, value]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        elif isinstance(value, Sequence):
            items = list(value)
            if not items or not all(isinstance(v, (str, int, float)) for v in items):
                raise ValueError(f"{where}: a list must be non-empty strings/numbers")
            argv += [flag, *(str(v) for v in items)]
        else:
            raise ValueError(f"{where}: unsupported value type {type(value).__name__}")
    return argv


def serve_argv(
    launcher: Sequence[str],
    model: str,
    engine_args: Mapping[str, Any],
    *,
    host: str,
    port: int,
    served_model_name: str | None = None,
) -> list[str]:
    """The full command: launcher (e.g. ["vllm", "serve"] or a python -m api_server), model,
    host/port, served name, then the rendered engine args."""
    if not model:
        raise ValueError("model: a model name or directory is required")
    if not 0 < port < 65536:
        raise ValueError(f"port={port}: must be within 1..65535")
    argv = [*launcher]
    if list(launcher[-1:]) == ["serve"]:
        argv.append(model)  # `vllm serve MODEL`
    else:
        argv += ["--model", model]  # python -m vllm.entrypoints.openai.api_server --model M
    argv += ["--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv + render_engine_args(engine_args)
