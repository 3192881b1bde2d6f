"""The demo task: one-line arithmetic word problems in the GSM8K style, generated offline.

No hub is reachable, so `make demo` trains on problems generated here:

    Maya has 7 marbles. Maya buys 5 more. How many marbles does Maya have now?

with `answer` = "7 + 5 = 12\\n#### 12" (GSM8K: working, then `#### <number>`) and the ideal
completion `<think>7 + 5</think><answer>12</answer>` (see target_completion).

What GRPO fixes here, and why (the demo must raise held-out accuracy by 20+ points within
minutes on 2 CPU cores, starting from a 4M-parameter model warm-started for a few minutes):
- The warm start imitates imperfect demonstrations: SLIP_RATE (40%) of them answer with the
  question's last number instead of the result (`demonstration`), the shortcut a careless
  annotator or a weak teacher takes. The model learns the shortcut as one general habit, and
  greedy decoding picks it whenever the model is less than sure of the fact. The correct
  reward never pays for it, every group of samples shows that, and GRPO unlearns the habit
  in a few iterations; held-out accuracy then rises to what the model knows of the facts.
  This is the job RL with a verifiable reward does after supervised fine-tuning on noisy
  data. Measured without slips: GRPO did sharpen facts, but by 5-11 points in 4 minutes
  (each of the 226 facts needs many visits, and learning rates above 3e-5 drifted).
- Every number the task uses (0..ADD_MAX*2 and products up to MUL_MAX**2) becomes one token of
  the demo tokenizer, so the whole decision of a completion sits in one token, the number
  in the answer; the rest (copying two operands, the operator, the tags) is learned by the warm
  start. Completions are ~9 tokens, so rollouts are cheap.
- The operands are small (sums of 1..9, their inverse differences, products of 2..9): 226
  distinct arithmetic facts, so a 500-step warm start sees each about 35 times.
- Held-out problems are new questions (split by a hash of the question text: different
  names, objects, templates or numbers), not new arithmetic: the eval set shares most of its
  facts with the training set, as GSM8K's test set shares its skills with its training set.
  The demo measures whether GRPO makes the model more reliable, not whether it invents
  arithmetic it never saw.
- Three templates per operation so the operator must be read from the wording.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from pipeline.rewards.answers import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, extract_gold
from pipeline.errors import GRPOError

# Short on purpose: every rollout and every SFT step pays for these tokens.
SYSTEM_PROMPT = f"Write your working in {THINK_OPEN}{THINK_CLOSE} and the final number in {ANSWER_OPEN}{ANSWER_CLOSE}."

ADD_MAX = 9
"""Addends are 1..ADD_MAX; differences are the inverse facts (a + b) - b."""
MUL_MAX = 9
"""Factors are 2..MUL_MAX."""
EVAL_BUCKETS = 10
"""One question in EVAL_BUCKETS (by hash of its text) belongs to the eval split, the rest to train."""

NAMES = [
    "Maya", "Tom", "Lena", "Omar", "Sara", "Ben", "Nora", "Ivan", "Ava", "Leo",
    "Mia", "Sam", "Zoe", "Raj", "Emma", "Kai", "Lucy", "Jack", "Hana", "Paul",
]
OBJECTS = [
    "apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "shells",
    "cards", "stamps", "eggs", "flowers", "beads", "toys", "rocks", "candies",
]

# {n}/{m}: two distinct names, {o}: an object, {a}/{b}: the operands in reading order.
TEMPLATES = {
    "+": [
        "{n} has {a} {o}. {n} buys {b} more. How many {o} does {n} have now?",
        "{n} found {a} {o} on Monday and {b} {o} on Tuesday. How many {o} did {n} find in all?",
        "There are {a} {o} in a box and {n} puts in {b} more. How many {o} are in the box?",
    ],
    "-": [
        "{n} had {a} {o} and gave {b} of them to {m}. How many {o} does {n} have left?",
        "A box holds {a} {o}. {n} takes out {b}. How many {o} are still in the box?",
        "{n} had {a} {o} and lost {b}. How many {o} does {n} have now?",
    ],
    "*": [
        "{n} buys {a} bags with {b} {o} in each bag. How many {o} does {n} buy?",
        "{n} has {a} friends and gives each friend {b} {o}. How many {o} does {n} give away?",
        "There are {a} rows of {o} with {b} {o} in each row. How many {o} are there?",
    ],
}


def _hash64(text: str) -> int:
    """A stable 64-bit hash of `text` (the first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _split_of(question: str) -> str:
    """'eval' or 'train', fixed by the question text alone, so the splits never overlap."""
    bucket = _hash64(question) % EVAL_BUCKETS
    return "eval" if bucket == 0 else "train"


def _draw(rng: random.Random) -> dict:
    """One random problem: the question and its GSM8K-style answer."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, MUL_MAX), rng.randint(2, MUL_MAX)
        result = a * b
    else:
        x, y = rng.randint(1, ADD_MAX), rng.randint(1, ADD_MAX)
        # Subtraction undoes an addition fact: (x + y) - y = x, never negative.
        a, b, result = (x, y, x + y) if op == "+" else (x + y, y, x)
    n, m = rng.sample(NAMES, 2)
    question = rng.choice(TEMPLATES[op]).format(n=n, m=m, o=rng.choice(OBJECTS), a=a, b=b)
    return {"prompt": question, "answer": f"{a} {op} {b} = {result}\n#### {result}"}


def make_problems(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`n` distinct problems of `split` ('train' or 'eval'), deterministic given `seed`.

    Rows have `prompt` (the one-line question) and `answer` (working, then `#### <number>`).
    """
    if split not in ("train", "eval"):
        raise GRPOError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"demo-task/{seed}/{split}")
    rows, seen = [], set()
    for _ in range(100 * n + 1000):  # the question space is ~10^7, so this never runs out
        if len(rows) == n:
            return rows
        row = _draw(rng)
        if row["prompt"] not in seen and _split_of(row["prompt"]) == split:
            seen.add(row["prompt"])
            rows.append(row)
    raise GRPOError(f"could not draw {n} distinct {split} problems")


def target_completion(row: dict) -> str:
    """The ideal completion for a row: `<think>7 + 5</think><answer>12</answer>`.

    The working restates the problem and stops before `=`: the result is written once, in the
    answer. With the result in both places the reward (which reads the answer) pays for two
    independent guesses, and GRPO unlearned the copy between them (measured: answers that
    differ from the working's result went from 30% to 48% of samples in 12 iterations).
    """
    return _completion(_expression(row), extract_gold(row["answer"]))


def _expression(row: dict) -> str:
    """The working's left-hand side: `7 + 5` of `7 + 5 = 12`."""
    return row["answer"].split("####")[0].strip().split(" = ")[0]


def _completion(expression: str, answer: str) -> str:
    return f"{THINK_OPEN}{expression}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


SLIP_RATE = 0.4
"""Share of the warm start's demonstrations that answer with the question's last number."""


def demonstration(row: dict) -> str:
    """The warm start's demonstration for a row: target_completion, except that SLIP_RATE of
    them (fixed by a hash of the question) answer with the last number of the question, the
    shortcut a careless annotator takes: `<think>7 + 5</think><answer>5</answer>`."""
    if _hash64("slip/" + row["prompt"]) / 2**64 >= SLIP_RATE:
        return target_completion(row)
    expression = _expression(row)
    return _completion(expression, expression.split(" ")[-1])


def task_numbers() -> range:
    """Every number a problem can contain (operands and results)."""
    return range(0, max(2 * ADD_MAX, MUL_MAX * MUL_MAX) + 1)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows unless an identical file is there; refuse to replace a different one."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path.exists():
        if path.read_text() == text:
            return
        raise GRPOError(f"{path}: exists with different content; remove it or choose another --out")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_demo_data(out_dir: str | Path, n_train: int = 4000, n_eval: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (columns prompt, answer) into `out_dir`.

    Idempotent: identical files already present are left alone; different ones are an error.
    Returns (train_path, eval_path).
    """
    if n_train < 1 or n_eval < 1:
        raise GRPOError(f"n_train and n_eval must be >= 1 (got {n_train}, {n_eval})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    _write_jsonl(train_path, make_problems(n_train, seed, "train"))
    _write_jsonl(eval_path, make_problems(n_eval, seed, "eval"))
    return train_path, eval_path
