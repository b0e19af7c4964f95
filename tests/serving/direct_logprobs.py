"""Next-token log-probabilities computed directly from the tiny model's logits, with torch and
transformers: the independent side of tests/serving/test_fidelity_kl.py. It runs inside the vLLM
venv (the project's venv has no torch), as a subprocess:

    $VENV/bin/python tests/serving/direct_logprobs.py derive SRC DST SCALE [int8]
        a copy of the model in SRC whose lm_head weights are multiplied by SCALE (its logits, so
        its next-token distributions, SCALE times sharper); with ``int8``, every decoder
        projection's weights also rounded to int8 per output row (absmax / 127, kept as float32:
        weight-only int8 quantization simulated, a numerics change float32 compute reproduces)
    $VENV/bin/python tests/serving/direct_logprobs.py logprobs < request.json > answer.json
        request: {"k": K, "sides": {NAME: {"model": DIR, "dtype": "float32" | "bfloat16"}},
        "pairs": [[REFERENCE, CANDIDATE], ...], "sequences": [{"ids": [...], "start": S}]};
        answer, per sequence: for each side and each position j in S..len(ids)-1 (the
        distribution of ids[j] given ids[:j], vLLM's prompt_logprobs[j]), the logprob of ids[j]
        and the top-K {token id: logprob}; for each pair, per position, the top-K truncated
        KL(reference || candidate) computed here in float64 (fidelity.compare's coarsening,
        implemented again) with its shared-token count, and the full KL over the vocabulary.

As vLLM does: the model loaded in the dtype, logits in that dtype, log_softmax in float32.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys


def derive(src: pathlib.Path, dst: pathlib.Path, scale: float, int8: bool) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    if int8:
        for name, w in weights.items():
            if name.endswith("_proj.weight"):
                step = w.abs().amax(dim=1, keepdim=True) / 127
                weights[name] = (w / step).round().clamp(-127, 127) * step
    weights = {name: w.contiguous() for name, w in weights.items()}
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})


def _truncated_kl(p_top: dict[int, float], q_top: dict[int, float]) -> tuple[float, int]:
    import math

    shared = [t for t in p_top if t in q_top]
    p = {t: math.exp(p_top[t]) for t in shared}
    q = {t: math.exp(q_top[t]) for t in shared}
    p_rest, q_rest = max(0.0, 1.0 - sum(p.values())), max(0.0, 1.0 - sum(q.values()))
    kl = sum(p[t] * math.log(p[t] / q[t]) for t in shared if p[t] > 0)
    if p_rest > 0:
        kl = math.inf if q_rest <= 0 else kl + p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), len(shared)


def logprobs(request: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    k, sides, sequences = int(request["k"]), request["sides"], request["sequences"]
    full: dict[str, list] = {}  # side -> per sequence, (positions x vocab) float32 log-probs
    for name, side in sides.items():
        dtype = getattr(torch, side["dtype"])
        model = AutoModelForCausalLM.from_pretrained(side["model"], dtype=dtype).eval()
        with torch.no_grad():
            # vLLM: logits in the model's dtype, Sampler.compute_logprobs upcasts in log_softmax
            full[name] = [
                model(torch.tensor([s["ids"]])).logits[0].log_softmax(dim=-1, dtype=torch.float32)
                for s in sequences
            ]
    out: dict = {"k": k, "sequences": []}
    for n, seq in enumerate(sequences):
        ids, start = seq["ids"], int(seq["start"])
        entry: dict = {"sides": {}, "pairs": {}}
        for name in sides:
            positions = []
            for j in range(start, len(ids)):
                row = full[name][n][j - 1]  # the logits at j - 1 predict the token at j
                top = row.topk(k)
                positions.append(
                    {
                        "token": ids[j],
                        "logprob": row[ids[j]].item(),
                        "top": {str(t): v for t, v in zip(top.indices.tolist(), top.values.tolist())},
                    }
                )
            entry["sides"][name] = positions
        for ref, cand in request.get("pairs", []):
            rows = []
            for j, (pr, pc) in enumerate(zip(entry["sides"][ref], entry["sides"][cand])):
                kl, shared = _truncated_kl(
                    {int(t): v for t, v in pr["top"].items()}, {int(t): v for t, v in pc["top"].items()}
                )
                p_log = full[ref][n][start + j - 1].double()
                q_log = full[cand][n][start + j - 1].double()
                rows.append(
                    {"kl": kl, "shared": shared, "full": (p_log.exp() * (p_log - q_log)).sum().item()}
                )
            entry["pairs"][f"{ref}|{cand}"] = rows
        out["sequences"].append(entry)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["derive"] and len(argv) in (4, 5) and argv[4:] in ([], ["int8"]):
        derive(pathlib.Path(argv[1]), pathlib.Path(argv[2]), float(argv[3]), argv[4:] == ["int8"])
        return 0
    if argv == ["logprobs"]:
        json.dump(logprobs(json.load(sys.stdin)), sys.stdout)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
