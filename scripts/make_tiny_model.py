"""Make a tiny random-weight Llama that real vLLM can serve, with no download.

Runs inside the vLLM venv (it needs torch, transformers and tokenizers):

    $(scripts/vllm_cpu.sh)/bin/python scripts/make_tiny_model.py [--out DIR]

Default DIR: /var/cache/abplat/tiny-llama (env ABPLAT_TINY_MODEL). Idempotent: a marker file
naming the recipe version makes a second run instant. Recipe (docs/services.md): byte-level BPE
tokenizer, vocab 2048, trained on local text; a chat template; Llama hidden 256, intermediate 512,
2 layers, 4 heads, head_dim 64 (head_dim 16 starts, then kills the engine at the first request).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

RECIPE = "tiny-llama-v1"
VOCAB = 2048
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    # Local, deterministic text: the Python standard library's own sources.
    stdlib = pathlib.Path(os.__file__).parent
    files = sorted(stdlib.glob("*.py"))[:200]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    # A little CJK and emoji, so the vocabulary has multi-byte pieces to emit.
    texts.append("你好世界 这是一个测试 模型 延迟 吞吐量 😀 🚀 ✨ café naïve " * 50)
    return texts


def make(out: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("ABPLAT_TINY_MODEL", "/var/cache/abplat/tiny-llama")
    ap.add_argument("--out", default=default, help=f"output directory (default {default})")
    out = pathlib.Path(ap.parse_args().out)
    marker = out / ".abplat-recipe"
    if marker.is_file() and marker.read_text().strip() == RECIPE:
        print(out)
        return 0
    make(out)
    marker.write_text(RECIPE + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
