"""What the GPU proof trains, made on the machine that runs it (real weights cannot travel):
a model of Qwen2.5-0.5B's shape with random weights, a byte-level BPE tokenizer of its vocabulary
size built without training, prompts, and a config.

The tokenizer's vocabulary is the 256 byte symbols, then every pair of them, then triples (a pair
and a symbol) until Qwen2.5's 151,936 ids are filled, each merge made of two tokens before it:
any text encodes and every id the random model samples decodes, so the reward reads real text and
the work per token (embedding, LM head over 151,936 ids) is the real model's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-0.5B's config.json (the shape; weights are random)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
TINY = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


def build_tokenizer(vocab_size: int):
    from tokenizers import pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for ch in alphabet:
        vocab[ch] = len(vocab)
    room = vocab_size - 3  # the three special tokens come last
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= room:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    pairs = [t for t in vocab if len(t) == 2]
    for ab in pairs:
        for c in alphabet:
            if len(vocab) >= room:
                break
            vocab[ab + c] = len(vocab)
            merges.append((ab, c))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=IM_END, pad_token=PAD, unk_token=None,
                         extra_special_tokens=[IM_START], model_max_length=32768, clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(out: Path, shape: dict, seed: int = 0) -> Path:
    """A Qwen2 of `shape` with random weights and the tokenizer above, saved as an HF directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(shape["vocab_size"])
    assert len(tok) <= shape["vocab_size"], (len(tok), shape["vocab_size"])
    conf = Qwen2Config(**shape, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids(IM_END),
                       pad_token_id=tok.convert_tokens_to_ids(PAD))
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(conf)
    model.to(torch.bfloat16).save_pretrained(out)  # the real checkpoint's dtype
    tok.save_pretrained(out)
    return out


TOPICS = ["rivers", "bridges", "bees", "clocks", "glaciers", "markets", "violins", "comets", "forests", "trains",
          "bread", "lighthouses", "owls", "deserts", "maps", "kites"]


def write_data(out: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = [{"prompt": f"Write {rng.randint(2, 9)} sentences about {rng.choice(TOPICS)} for a child aged {rng.randint(5, 12)}."}
            for _ in range(n)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


SIZES = {
    # the realistic work: 16 prompts x G 8 x 256 new tokens, 3 iterations
    "real": dict(shape=QWEN25_05B, prompts=16, G=8, tokens=256, iters=3, mini_batch=32, budget=16384),
    # the dry run on a CPU: the same steps, small enough for two cores
    "small": dict(shape=TINY, prompts=2, G=4, tokens=16, iters=2, mini_batch=8, budget=1024),
}


def config(model: Path, data: Path, reward: str, size: str, lora: bool, engine: str = "hf") -> dict:
    """The proof's run config; `engine` vllm samples with vLLM and hands each new policy's weights to it
    in memory (`rollout.weight_sync: memory`, full fine-tuning only), as the CPU path does."""
    s = SIZES[size]
    cfg = {
        "model": str(model),
        "seed": 0,
        "data": {"train": str(data), "system_prompt": "You are a careful writer."},
        "rollout": {"engine": engine, "num_generations": s["G"], "prompts_per_iter": s["prompts"],
                    "max_new_tokens": s["tokens"], "temperature": 1.0},
        "rewards": [{"fn": reward}],
        "loss": {"kl_coef": 0.04},
        "train": {"lr": 1.0e-6, "mini_batch_size": s["mini_batch"], "epochs": 1, "zero_stage": 2, "bf16": True,
                  "precision": "auto", "update_token_budget": s["budget"]},
        "tracking": {"mlflow": False},
    }
    if engine == "vllm":
        cfg["rollout"]["weight_sync"] = "memory"
    if lora:
        cfg["train"]["lora"] = {"r": 16, "alpha": 32}
        cfg["train"]["lr"] = 1.0e-5
    return cfg
