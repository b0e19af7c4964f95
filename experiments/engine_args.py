"""Render a variant's ``engine_args`` to a ``vllm serve`` command line, and say which engine
flags a variant may carry. Pure.

Rendering follows vLLM's argparse conventions: a key ``max_model_len`` becomes
``--max-model-len``; ``True`` is a bare flag, ``False`` its ``--no-`` form (vLLM's boolean
flags all take one: ``enable_prefix_caching: false`` must turn on-by-default prefix caching
off, not leave it on), ``None`` is left out (vLLM's default), a list repeats its values after one flag, a dict is passed as compact JSON (vLLM's
JSON-valued options such as ``--compilation-config``). Host, port, model and served name belong
to the launcher, not to the variant, so engine_args may not set them.

Who may set which flag: product users write engine_args, vLLM runs them on a GPU
host, and some vLLM flags are code execution there (``--trust-remote-code`` runs Python shipped
with the model; ``--worker-cls``, ``--middleware``, ``--logits-processors`` import a named
object) or read and write host paths. So:

1. ``ALLOWED``: the performance knobs an experiment compares (precision, memory and KV cache,
   scheduler, parallelism, kernels). Product users set these freely.
2. ``RISKY``: flags with a legitimate use that reach outside the engine (remote code, host
   paths, another model, tokenizer or revision). A document may carry them, but
   ``serve_variant`` serves one only when an operator names it on the command line,
   ``--allow-risky-engine-args trust-remote-code,download-dir``. A risky flag set to false or
   null renders nothing, so it needs no one's permission.
3. Every other flag is rejected, when the document is applied and at serve time, even with the
   operator option: a flag joins a list by a reviewed change to this module.

A string value (or list item) may not start with ``-``: argparse would read it as a flag of its
own (``cudagraph_capture_sizes: [8, "--trust-remote-code"]`` would switch remote code on).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
RESERVED = ("host", "port", "model", "served_model_name")

# What a product user may tune. Names of older vLLM releases (swap_space, num_scheduler_steps,
# max_seq_len_to_capture, ...) are kept: the GPU build in production may lag the CPU one.
ALLOWED = frozenset(
    {
        # precision and model length
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "calculate_kv_scales",
        "max_model_len",
        "seed",
        "max_logprobs",
        # memory and KV cache
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "block_size",
        "num_gpu_blocks_override",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "swap_space",
        "cpu_offload_gb",
        # scheduler
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "scheduling_policy",
        "async_scheduling",
        "stream_interval",
        "num_scheduler_steps",
        "disable_log_stats",
        # compilation and CUDA graphs
        "enforce_eager",
        "optimization_level",
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        "max_seq_len_to_capture",
        # parallelism
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_expert_parallel",
        "disable_custom_all_reduce",
        # kernels
        "attention_backend",
        "moe_backend",
        "disable_sliding_window",
        "disable_cascade_attn",
        # speculative decoding without a second model (spec_model is risky)
        "spec_method",
        "spec_tokens",
        "num_speculative_tokens",
    }
)

# Operator-approved only: what each one reaches, said in the error a product user sees.
RISKY: dict[str, str] = {
    "trust_remote_code": "runs Python code shipped with the model on the serving host",
    "code_revision": "picks which revision of the model's remote code runs on the serving host",
    "revision": "serves another revision of the model repository than the one reviewed",
    "tokenizer": "loads a tokenizer from another path or repository",
    "tokenizer_mode": "selects how the tokenizer is loaded (custom tokenizers run code)",
    "tokenizer_revision": "loads another revision of the tokenizer",
    "download_dir": "writes model weights to a directory of the serving host",
    "load_format": "selects the weights loader (pickled checkpoints, remote streamers)",
    "hf_config_path": "reads the model config from another path or repository",
    "generation_config": "reads generation defaults from a path of the serving host",
    "chat_template": "reads a template file from the serving host",
    "spec_model": "loads a second model for speculative decoding",
    "compilation_config": "can import compiler passes by name on the serving host",
}


def flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


def _names(keys: Iterable[str]) -> str:
    return ", ".join(sorted(k.replace("_", "-") for k in keys))


ALLOWED_TEXT = _names(ALLOWED)
RISKY_TEXT = _names(RISKY)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One rejected engine arg: ``key`` as the variant spells it, ``message`` says why."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"engine_args{'.' + self.key if self.key else ''}: {self.message}"


class EngineArgsError(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def parse_allow_risky(values: Iterable[str]) -> frozenset[str]:
    """The operator's ``--allow-risky-engine-args`` values ("trust-remote-code,download-dir",
    possibly repeated) as engine_args keys. A name that is not a risky flag is an error: a typo
    must not pass silently, and flags outside the lists cannot be enabled from the command line."""
    names = set()
    for value in values:
        for item in value.split(","):
            name = item.strip().removeprefix("--").replace("-", "_")
            if not name:
                continue
            if name not in RISKY:
                allowed = " (product users may set it without this option)" if name in ALLOWED else ""
                raise ValueError(
                    f"{flag_of(name)} is not a risky engine flag{allowed}; the risky ones are: {RISKY_TEXT}"
                )
            names.add(name)
    return frozenset(names)


def unknown_flag_message(key: str) -> str:
    """Why ``key`` is refused and what to write instead: the closest flag a variant may set (or
    an operator may allow) when one is that close (a typo), else both lists."""
    close = difflib.get_close_matches(key, sorted(ALLOWED | RISKY.keys()), n=1, cutoff=0.75)
    refused = f"{flag_of(key)} is not an engine flag a variant may set"
    if close and close[0] in RISKY:
        return f"{refused}; did you mean {flag_of(close[0])}? (a risky one: {RISKY[close[0]]})"
    if close:
        return f"{refused}; did you mean {flag_of(close[0])}?"
    return (
        f"{refused}. Allowed: {ALLOWED_TEXT}. "
        f"Only with an operator's serve_variant --allow-risky-engine-args: {RISKY_TEXT}"
    )


def _value_problem(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r}: must be a finite number"
    if isinstance(value, (int, float)):
        return None
    if isinstance(value, str):
        if not value:
            return "empty string; leave the key out for vLLM's default"
        if value.startswith("-"):
            return f"{value!r}: a value may not start with '-' (vLLM would read it as another flag)"
        return None
    if isinstance(value, Mapping):
        return None  # one JSON argument: it cannot be read as a flag
    if isinstance(value, Sequence):
        items = list(value)
        if not items or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            return "a list must be non-empty strings/numbers"
        for item in items:
            problem = _value_problem(item)
            if problem:
                return f"list item {problem}"
        return None
    return f"unsupported value type {type(value).__name__}"


def check_engine_args(engine_args: Mapping[str, Any], allow_risky: Collection[str] = ()) -> list[Problem]:
    """Every problem with these engine args, [] when a product user may set them all.
    ``allow_risky``: the RISKY keys an operator allowed (pass ``RISKY`` to accept any risky flag,
    as a document does: serving it still needs the operator)."""
    if not isinstance(engine_args, Mapping):
        return [Problem("", f"expected an object, got {type(engine_args).__name__}")]
    problems: list[Problem] = []
    for key in sorted(engine_args, key=str):
        value = engine_args[key]
        if not isinstance(key, str) or not _KEY.match(key):
            problems.append(Problem(str(key), "use snake_case names like max_model_len"))
            continue
        flag = flag_of(key)
        if key in RESERVED:
            problems.append(Problem(key, "set by the launcher (--host/--port/--model), not here"))
            continue
        if key in RISKY:
            if key not in allow_risky and value is not None and value is not False:
                problems.append(
                    Problem(
                        key,
                        f"{flag} {RISKY[key]}; it is served only when an operator allows it: "
                        f"serve_variant ... --allow-risky-engine-args {flag.removeprefix('--')}",
                    )
                )
                continue
        elif key not in ALLOWED:
            problems.append(Problem(key, unknown_flag_message(key)))
            continue
        problem = _value_problem(value)
        if problem:
            problems.append(Problem(key, problem))
    return problems


def render_engine_args(engine_args: Mapping[str, Any], allow_risky: Collection[str] = ()) -> list[str]:
    """The flags, sorted (the same args always give the same command); EngineArgsError (a
    ValueError) naming every rejected key."""
    problems = check_engine_args(engine_args, allow_risky)
    if problems:
        raise EngineArgsError(problems)
    argv: list[str] = []
    for key in sorted(engine_args):
        value = engine_args[key]
        flag = flag_of(key)
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, (int, float, str)):
            argv += [flag, str(value)]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(value, separators=(",", ":"), sort_keys=True)]
        else:
            argv += [flag, *(str(v) for v in value)]
    return argv


def serve_argv(
    launcher: Sequence[str],
    model: str,
    engine_args: Mapping[str, Any],
    *,
    host: str,
    port: int,
    served_model_name: str | None = None,
    allow_risky: Collection[str] = (),
) -> list[str]:
    """The full command: launcher (e.g. ["vllm", "serve"] or a python -m api_server), model,
    host/port, served name, then the rendered engine args (``allow_risky``: the RISKY flags an
    operator allowed)."""
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
    return argv + render_engine_args(engine_args, allow_risky)
