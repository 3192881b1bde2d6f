"""One-step multiplication word problems for the real-model demo, generated offline (no hub).

    python examples/times_problems.py OUT_DIR [--train 2000] [--eval 100] [--seed 0]

writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl, one problem a line: {"prompt": the question
(one user turn; no system prompt, so the chat template's own), "answer": "42" (the gold integer
as text), "working": "6 * 7 = 42" (one correct solution, not shown to the model)}. Each problem
multiplies two numbers from 2 to 9 in one of six everyday wordings (bags of things, rows of
chairs, pages a day, prices, boxes, weekly savings), with names, objects and numbers drawn from
the seed. Held-out questions are the ones whose text hashes into the eval bucket, so no eval
question appears in train.

Why this task: SmolLM2-135M-Instruct knows its times tables (asked `What is 6 * 7?` after one
worked example it is right 83 % of the time) but, asked a word problem, it explains at length
before it multiplies: greedy, with 32 new tokens, 25 % of its answers end on the right number
(measured on 60 problems, 2026-11-25). The rest run out of tokens mid-sentence, or divide, or
restate the question. That gap is what a few GRPO iterations can close: sampled at temperature
0.8, 4 per problem, 28 of 60 problems had both right and wrong samples to learn from.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from splits import cli, write_splits

SYSTEM_PROMPT = None
"""No system prompt: SmolLM2's chat template puts its own default in front."""

NAMES = ["Maya", "Tom", "Lena", "Omar", "Sara", "Ben", "Nora", "Ivan", "Ava", "Leo", "Mia", "Sam", "Zoe", "Raj", "Emma", "Kai"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "eggs", "stamps"]
CONTAINERS = ["bags", "boxes", "packs", "jars", "baskets"]
EVAL_BUCKETS = 20
LOW, HIGH = 2, 9


def _bags(r: random.Random, a: int, b: int) -> str:
    n, it, c = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    return f"{n} has {a} {c} with {b} {it} in each. How many {it} does {n} have?"


def _rows(r: random.Random, a: int, b: int) -> str:
    return f"There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?"


def _pages(r: random.Random, a: int, b: int) -> str:
    n = r.choice(NAMES)
    return f"{n} reads {b} pages every day for {a} days. How many pages does {n} read?"


def _price(r: random.Random, a: int, b: int) -> str:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    return f"A pack of {it} costs ${b}. {n} buys {a} packs. How many dollars does {n} spend?"


def _boxes(r: random.Random, a: int, b: int) -> str:
    it, c = r.choice(ITEMS), r.choice(CONTAINERS)
    return f"Each of {a} {c} holds {b} {it}. How many {it} are there in all?"


def _savings(r: random.Random, a: int, b: int) -> str:
    n = r.choice(NAMES)
    return f"{n} saves ${b} every week for {a} weeks. How many dollars does {n} save?"


TEMPLATES = [_bags, _rows, _pages, _price, _boxes, _savings]


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % EVAL_BUCKETS


def problems(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems, split by a hash of the question: (train, eval)."""
    r = random.Random(seed)
    train, eval_, seen = [], [], set()
    while len(train) < n_train or len(eval_) < n_eval:
        a, b = r.randint(LOW, HIGH), r.randint(LOW, HIGH)
        q = r.choice(TEMPLATES)(r, a, b)
        if q in seen:
            continue
        seen.add(q)
        split = eval_ if _bucket(q) == 0 else train
        if len(split) < (n_eval if split is eval_ else n_train):
            split.append({"prompt": q, "answer": str(a * b), "working": f"{a} * {b} = {a * b}"})
    return train, eval_


def write(out: Path, n_train: int = 2000, n_eval: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """Write OUT/train.jsonl and OUT/eval.jsonl (same seed, same bytes)."""
    return write_splits(out, problems(n_train, n_eval, seed))


if __name__ == "__main__":
    cli(write, __doc__)
