"""Tiny Qwen2 policies built locally (no hub): tokenizer, model, supervised warm start, greedy eval.

`grpo make-model models/tiny --data data/demo` builds the demo's starting policy:

    byte-level BPE on the demo text  ->  Qwen2ForCausalLM (random init, seeded)
    ->  a short supervised warm start on prompt + ideal completion  ->  save_pretrained
    ->  held-out greedy accuracy on eval.jsonl, recorded in make_model.json

The warm start is deliberately short: it teaches the format and some of the arithmetic, so the
model is "sometimes right" and GRPO has groups with a reward spread to learn from.
Deterministic: the same seed and settings give byte-identical weights on the same machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from demo import task as demo_task
from demo.settings import SFT_BATCH, SFT_LR, SFT_STEPS
from pipeline.rewards import answers
from pipeline.errors import GRPOError

if TYPE_CHECKING:  # heavy imports stay inside the functions (`grpo --help` must be instant)
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TAGS = [answers.THINK_OPEN, answers.THINK_CLOSE, answers.ANSWER_OPEN, answers.ANSWER_CLOSE]

# ChatML, as Qwen2 uses it. Without a system message the demo's system prompt is inserted (as
# Qwen's templates insert theirs), so a prompt rendered without one still matches the warm start.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Added (not special) tokens, matched in the raw text before any splitting, one id each:
# the tags, every one- or two-digit number, and an operator between spaces. A number is then
# the same single token in the question, the working and the answer (longer digit runs are cut
# into two-digit pieces), and `7 + 5 = 12` is `7`, ` + `, `5`, ` = `, `12`: the token that
# predicts a number says which slot it fills, so copying operands is a one-step attention.
# Measured: with `Ġ` (a bare space) before each number in the working, 400 warm-start steps
# did not learn to copy the operands; with these tokens, 150 steps did.
NUMBERS = [str(i) for i in range(100)]
OPERATORS = [" + ", " - ", " * ", " = "]
ADDED = TAGS + OPERATORS + NUMBERS

SIZES = {
    # ~5M parameters with the demo vocabulary (~600 tokens); head_dim 64 (vLLM CPU supports it).
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # ~30M parameters.
    "small": dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
}
Size = Literal["tiny", "small"]

RECIPE = 2
"""Version of what make_model builds from the same settings (tokenizer, demonstrations); an
output with another recipe is not reused."""
THREADS = 1
"""Torch threads of the warm start and its greedy eval (see torch_threads)."""


@contextmanager
def torch_threads(n: int | None):
    """Run torch ops on `n` threads inside the block (None: leave torch's setting).

    The warm start uses 1: the weights then do not depend on the machine's core count, and two
    OpenMP threads slow down ~10x (measured: 0.7 s vs 12 s per step) when another process
    shares the two cores.
    """
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tokenizer(texts: list[str], vocab_size: int = 1024) -> "PreTrainedTokenizerFast":
    """Byte-level BPE trained on `texts`, as a Qwen2Tokenizer with ChatML and the demo's added tokens.

    Qwen2's own normalizer and pre-tokenizer are used because transformers 5 rebuilds every
    tokenizer saved beside a qwen2 model with them (from vocab and merges); training with the
    same ones makes what loads back (AutoTokenizer, vLLM) identical to what was built here.
    The ADDED tokens survive `decode(..., skip_special_tokens=True)`; `<|im_end|>` is the eos
    (end of the assistant turn) and `<|endoftext|>` the pad.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )

    def without_added(text: str) -> str:  # added tokens get their own ids; keep them out of the merges
        for token in TAGS + OPERATORS:
            text = text.replace(token, " ")
        return text

    bpe.train_from_iterator([without_added(t) for t in texts], trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m) for m in trained["merges"]],
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        extra_special_tokens=[IM_START],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED])
    tokenizer.chat_template = CHAT_TEMPLATE.replace("default_system", json.dumps(demo_task.SYSTEM_PROMPT))
    return tokenizer


def demo_texts(rows: list[dict]) -> list[str]:
    """The text a demo tokenizer is trained on: system prompt, chat roles, questions, ideal completions."""
    return [demo_task.SYSTEM_PROMPT, "system\nuser\nassistant"] + [
        text for r in rows for text in (r["prompt"], demo_task.target_completion(r))
    ]


def build_model(size: Size, tokenizer: "PreTrainedTokenizerFast", seed: int = 0) -> "PreTrainedModel":
    """A randomly initialised Qwen2ForCausalLM (fp32, tied embeddings, 512 positions)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise GRPOError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Both HF generate and vLLM stop at the end of the assistant turn.
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model


def count_params(model: "PreTrainedModel") -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def encode_sft(tokenizer: "PreTrainedTokenizerFast", row: dict) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a chat-formatted prompt + ideal completion; labels mask the prompt."""
    prompt = chat_prompt(tokenizer, row["prompt"])
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    completion_ids = tokenizer(demo_task.demonstration(row) + IM_END, add_special_tokens=False).input_ids
    return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids


def chat_prompt(tokenizer: "PreTrainedTokenizerFast", question: str) -> str:
    """The rendered prompt the policy sees: system + user turn, then the assistant header."""
    messages = [{"role": "system", "content": demo_task.SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _pad(seqs: list[list[int]], value: int) -> list[list[int]]:
    width = max(len(s) for s in seqs)
    return [s + [value] * (width - len(s)) for s in seqs]


def sft_loss(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerFast", rows: list[dict]) -> float:
    """Mean cross-entropy over the completion tokens of `rows` (no gradient)."""
    import torch

    encoded = [encode_sft(tokenizer, r) for r in rows]
    input_ids = torch.tensor(_pad([e[0] for e in encoded], tokenizer.pad_token_id))  # [B, L]
    labels = torch.tensor(_pad([e[1] for e in encoded], -100))  # [B, L]
    model.eval()
    with torch.no_grad(), torch_threads(1):
        return model(input_ids=input_ids, attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id), labels=labels).loss.item()


def warm_start(
    model: "PreTrainedModel",
    tokenizer: "PreTrainedTokenizerFast",
    rows: list[dict],
    steps: int = SFT_STEPS,
    lr: float = SFT_LR,
    batch_size: int = SFT_BATCH,
    seed: int = 0,
    threads: int | None = THREADS,
) -> list[float]:
    """Supervised fine-tuning on prompt + ideal completion, loss on the completion tokens only.

    AdamW, linear warm-up over the first 10% of steps then cosine decay to lr/10; batches are
    drawn by a seeded epoch-wise shuffle of `rows`, on `threads` torch threads (see
    torch_threads). Returns the loss of every step.
    """
    import torch

    if not rows:
        raise GRPOError("warm start needs at least one training row")
    torch.manual_seed(seed)
    encoded = [encode_sft(tokenizer, r) for r in rows]
    order_rng, order = random.Random(seed), []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    losses = []
    model.train()
    with torch_threads(threads):
        for step in range(steps):
            if len(order) < batch_size:  # next epoch, reshuffled
                order += order_rng.sample(range(len(encoded)), len(encoded))
            batch, order = [encoded[i] for i in order[:batch_size]], order[batch_size:]
            input_ids = torch.tensor(_pad([b[0] for b in batch], tokenizer.pad_token_id))  # [B, L]
            labels = torch.tensor(_pad([b[1] for b in batch], -100))  # [B, L]
            attention_mask = torch.tensor(_pad([[1] * len(b[0]) for b in batch], 0))  # [B, L]
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            # HF shifts labels inside: mean token cross-entropy over the completion tokens.
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    model.eval()
    return losses


def evaluate_greedy(model_dir: str | Path, rows: list[dict], max_new_tokens: int = 32) -> float:
    """Fraction of `rows` whose greedy completion's <answer> matches the `####` gold answer.
    Generates with the library's own engine (transformers generate, as `rollout.engine: hf`)."""
    if not rows:
        return 0.0
    from pipeline.config.rollout import RolloutConfig
    from pipeline.models.hf_engine import HFEngine

    engine = HFEngine(Path(model_dir), RolloutConfig(engine="hf", max_new_tokens=max_new_tokens), 0, 0)
    tok = engine.tokenizer
    prompts = [tok(chat_prompt(tok, r["prompt"]), add_special_tokens=False).input_ids for r in rows]
    with torch_threads(THREADS):
        groups = engine.generate(prompts, seeds=[0] * len(prompts), n=1, greedy=True)
    engine.close()
    hits = [answers.answers_match(answers.extract_answer(g[0].text), answers.extract_gold(r["answer"])) for g, r in zip(groups, rows)]
    return sum(hits) / len(rows)


def read_rows(path: Path) -> list[dict]:
    """Rows of a demo .jsonl file (string `prompt`, GSM8K `answer`); errors name file and line."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise GRPOError(f"{path}:{i}: not valid JSON") from None
        if not isinstance(row.get("prompt"), str) or answers.extract_gold(str(row.get("answer", ""))) is None:
            raise GRPOError(f"{path}:{i}: expected a string 'prompt' and an 'answer' ending in '#### <answer>'")
        rows.append(row)
    return rows


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_model(
    out_dir: str | Path,
    size: Size = "tiny",
    seed: int = 0,
    data_dir: str | Path | None = None,
    sft_steps: int = SFT_STEPS,
    lr: float = SFT_LR,
    batch_size: int = SFT_BATCH,
    vocab_size: int = 1024,
    max_new_tokens: int = 32,
) -> dict:
    """Build, warm-start (on data_dir/train.jsonl if given), evaluate and save a tiny policy.

    Writes an HF model directory (safetensors + tokenizer + generation_config) and
    `make_model.json`; returns that record. An `out_dir` that already holds a make-model output
    with the same settings is kept as it is (the call is skipped and returns the old record);
    any other non-empty `out_dir` is an error.
    """
    out = Path(out_dir)
    data = Path(data_dir) if data_dir is not None else None
    train_path = data / "train.jsonl" if data else None
    eval_path = data / "eval.jsonl" if data else None
    if train_path is not None and not train_path.is_file():
        raise GRPOError(f"{train_path}: not found (write it with `grpo make-data {data}`)")
    settings = {
        "recipe": RECIPE,
        "size": size,
        "seed": seed,
        "sft_steps": sft_steps if train_path else 0,
        "lr": lr,
        "batch_size": batch_size,
        "vocab_size_max": vocab_size,
        "train_sha256": _sha256(train_path) if train_path else None,
        "eval_sha256": _sha256(eval_path) if eval_path and eval_path.is_file() else None,
    }
    record_path = out / "make_model.json"
    if out.exists() and any(out.iterdir()):
        if record_path.is_file():
            previous = json.loads(record_path.read_text())
            if {k: previous.get(k) for k in settings} == settings:
                return previous | {"skipped": True}
        raise GRPOError(f"{out}: exists and is not empty (not a make-model output with these settings); choose another --out")

    if size not in SIZES:
        raise GRPOError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    train_rows = read_rows(train_path) if train_path else []
    eval_rows = read_rows(eval_path) if settings["eval_sha256"] else []
    # The vocabulary covers the demo task even when there is no data dir.
    tokenizer = build_tokenizer(demo_texts(train_rows or demo_task.make_problems(2000, seed, "train")), vocab_size)
    model = build_model(size, tokenizer, seed)
    losses = warm_start(model, tokenizer, train_rows, sft_steps, lr, batch_size, seed) if train_rows else []

    # Write into a sibling temporary directory, then rename: a crash leaves no half-written model.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    accuracy = evaluate_greedy(tmp, eval_rows, max_new_tokens) if eval_rows else None
    record = settings | {
        "params": count_params(model),
        "vocab_size": len(tokenizer),
        "sft_loss_first": losses[0] if losses else None,
        "sft_loss_last": losses[-1] if losses else None,
        "eval_accuracy": accuracy,
        "eval_rows": len(eval_rows),
        "max_new_tokens": max_new_tokens,
        "threads": THREADS,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - cpu0, 1),  # wall time depends on what else runs
    }
    (tmp / "make_model.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked above)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return record
