"""GSM8K-style word problems for the real-model demo, generated offline (no hub).

    python examples/word_problems.py OUT_DIR [--train 2000] [--eval 100] [--seed 0]

writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl, one problem a line: {"prompt": chat messages
(FEW_SHOT's worked examples, then the question), "question": the question, "answer": "42",
"working": "3 * 4 = 12. 30 + 12 = 42."}. `answer` is the gold integer as text (what seed 002's
`extract_hash_answer` gives for GSM8K), `working` one correct solution (not shown to the model). Every problem takes 2 or 3
arithmetic steps on small integers (+, -, *, exact /), with its numbers, names, objects and
wording drawn from the seed. Held-out questions are the ones whose text hashes into the eval
bucket, so no eval question appears in train.

SYSTEM_PROMPT is seed 002's (working between <start_working_out> and <end_working_out>, the
answer between <SOLUTION> and </SOLUTION>); FEW_SHOT's two worked examples, given as chat turns,
make a 135M instruct model use the tags often enough to learn from its first samples.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from splits import cli, write_splits

REASONING_START, REASONING_END = "<start_working_out>", "<end_working_out>"
SOLUTION_START, SOLUTION_END = "<SOLUTION>", "</SOLUTION>"

SYSTEM_PROMPT = (
    "You are given a problem.\n"
    "Think about the problem and provide your working out.\n"
    f"Place it between {REASONING_START} and {REASONING_END}.\n"
    f"Then, provide your solution between {SOLUTION_START}{SOLUTION_END}"
)
"""Seed 002's system prompt, word for word."""

FEW_SHOT = [
    ("Ava has 5 pencils. Ava buys 3 packs with 4 pencils in each. How many pencils does Ava have now?", "3 * 4 = 12. 5 + 12 = 17.", "17"),
    ("Cookies cost $3 each. Leo buys 4 cookies and pays with a $20 bill. How much change does Leo get?", "4 * 3 = 12. 20 - 12 = 8.", "8"),
]
"""Two worked examples given as earlier chat turns before each question. Measured on
SmolLM2-135M-Instruct (8 prompts x 4 samples x 128 tokens, temperature 0.8): with the format
only described in the system prompt (or one example inside it) no sample used a tag and every
group had zero spread; with these two turns 31 % of the samples earned format credit and 5 of 8
groups had a spread to learn from."""


def completion_for(working: str, answer: str) -> str:
    return f"{REASONING_START}{working}{REASONING_END}{SOLUTION_START}{answer}{SOLUTION_END}"


def messages(question: str) -> list[dict]:
    """The prompt column: the worked examples as chat turns, then the question (the run's
    data.system_prompt is put in front by the chat template)."""
    turns = []
    for q, working, answer in FEW_SHOT:
        turns += [{"role": "user", "content": q}, {"role": "assistant", "content": completion_for(working, answer)}]
    return turns + [{"role": "user", "content": question}]


NAMES = ["Maya", "Tom", "Lena", "Omar", "Sara", "Ben", "Nora", "Ivan", "Ava", "Leo", "Mia", "Sam", "Zoe", "Raj", "Emma", "Kai"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "eggs", "stamps"]
CONTAINERS = ["bags", "boxes", "packs", "jars", "baskets"]
EVAL_BUCKETS = 20


def _buy_more(r: random.Random) -> tuple[str, int, str]:
    n, a, b, it, c = r.choice(NAMES), r.randint(3, 30), r.randint(2, 6), r.choice(ITEMS), r.choice(CONTAINERS)
    k = r.randint(2, 9)
    return (f"{n} has {a} {it}. {n} buys {b} {c} with {k} {it} in each. How many {it} does {n} have now?",
            a + b * k, f"{b} * {k} = {b * k}. {a} + {b * k} = {a + b * k}.")


def _change(r: random.Random) -> tuple[str, int, str]:
    n, it, price, qty = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 9), r.randint(2, 6)
    paid = r.choice([p for p in (20, 50, 100) if p >= price * qty])
    return (f"{it.capitalize()} cost ${price} each. {n} buys {qty} {it} and pays with a ${paid} bill. How much change does {n} get?",
            paid - price * qty, f"{qty} * {price} = {price * qty}. {paid} - {price * qty} = {paid - price * qty}.")


def _give_away(r: random.Random) -> tuple[str, int, str]:
    n, m1, m2, it = r.choice(NAMES), r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    x, y = r.randint(2, 15), r.randint(2, 15)
    a = x + y + r.randint(1, 30)
    return (f"{n} has {a} {it}. {n} gives {x} to {m1} and {y} to {m2}. How many {it} does {n} have left?",
            a - x - y, f"{x} + {y} = {x + y}. {a} - {x + y} = {a - x - y}.")


def _daily(r: random.Random) -> tuple[str, int, str]:
    n, per, days, extra = r.choice(NAMES), r.randint(2, 12), r.randint(2, 7), r.randint(1, 20)
    return (f"{n} reads {per} pages every day for {days} days, then reads {extra} more pages. How many pages did {n} read in total?",
            per * days + extra, f"{per} * {days} = {per * days}. {per * days} + {extra} = {per * days + extra}.")


def _share(r: random.Random) -> tuple[str, int, str]:
    n, it, friends, each, eaten = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 6), r.randint(2, 8), r.randint(1, 9)
    total = friends * each + eaten
    return (f"{n} has {total} {it}. {n} keeps {eaten} and shares the rest equally among {friends} friends. How many {it} does each friend get?",
            each, f"{total} - {eaten} = {total - eaten}. {total - eaten} / {friends} = {each}.")


def _shelves(r: random.Random) -> tuple[str, int, str]:
    rows, per, gone, it = r.randint(2, 9), r.randint(3, 12), r.randint(1, 10), r.choice(ITEMS)
    gone = min(gone, rows * per - 1)
    return (f"There are {rows} shelves with {per} {it} on each shelf. Someone takes away {gone} {it}. How many {it} are left?",
            rows * per - gone, f"{rows} * {per} = {rows * per}. {rows * per} - {gone} = {rows * per - gone}.")


def _two_packs(r: random.Random) -> tuple[str, int, str]:
    n, it, c = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    a, x, b, y = r.randint(2, 5), r.randint(2, 9), r.randint(2, 5), r.randint(2, 9)
    g = r.randint(1, a * x + b * y - 1)
    total = a * x + b * y
    return (f"{n} buys {a} {c} of {x} {it} and {b} {c} of {y} {it}. {n} gives away {g} {it}. How many {it} does {n} keep?",
            total - g, f"{a} * {x} = {a * x}. {b} * {y} = {b * y}. {a * x} + {b * y} - {g} = {total - g}.")


def _weekly_savings(r: random.Random) -> tuple[str, int, str]:
    n, start, per, weeks = r.choice(NAMES), r.randint(5, 40), r.randint(2, 15), r.randint(2, 8)
    return (f"{n} has ${start} saved and saves ${per} more each week. How many dollars will {n} have after {weeks} weeks?",
            start + per * weeks, f"{per} * {weeks} = {per * weeks}. {start} + {per * weeks} = {start + per * weeks}.")


TEMPLATES = [_buy_more, _change, _give_away, _daily, _share, _shelves, _two_packs, _weekly_savings]


def _bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % EVAL_BUCKETS


def problems(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems, split by a hash of the question: (train, eval)."""
    r = random.Random(seed)
    train, eval_, seen = [], [], {q for q, _, _ in FEW_SHOT}
    while len(train) < n_train or len(eval_) < n_eval:
        q, ans, working = r.choice(TEMPLATES)(r)
        if q in seen:
            continue
        seen.add(q)
        split = eval_ if _bucket(q) == 0 else train
        limit = n_eval if split is eval_ else n_train
        if len(split) < limit:
            split.append({"prompt": messages(q), "question": q, "answer": str(ans), "working": working})
    return train, eval_


def write(out: Path, n_train: int = 2000, n_eval: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """Write OUT/train.jsonl and OUT/eval.jsonl (same seed, same bytes)."""
    return write_splits(out, problems(n_train, n_eval, seed))


if __name__ == "__main__":
    cli(write, __doc__)
