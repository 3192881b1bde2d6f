"""Multiplications too large to do in one's head, with a calculator tool, for the agent demo
(`make demo-agent`), generated offline.

    python examples/calc_problems.py OUT_DIR [--train 2000] [--eval 100] [--seed 0]

writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl, one problem a line: {"prompt": the
conversation (two worked calculator calls, then the question), "question": the question alone,
"answer": the product as text}. A problem multiplies a number from 100 to 999 by one from 11 to
99 (in either order), asked in one of five wordings, so a 135M model cannot know the answer; with
the `multiply` tool (examples/calc_tools.py) it can. Held-out questions are the ones whose text
hashes into the eval bucket, so none appears in train.

The worked calls are in the Hermes format SmolLM2's template falls back to (docs/agents.md), each
answered with the bare product. They show the call's shape; SmolLM2-135M-Instruct still answers
greedily from its head (no call on 50 of 50 held-out questions, none right) and calls the tool in
about 1 sample in 16 at temperature 0.8 (4 of 64): rare, which is what GRPO amplifies (measured
2026-11-25). With one worked call, or with a worked answer that restates the product as a
sentence, it called in 0 of 64 samples: nothing to learn from.
"""

from __future__ import annotations

import json
import random

from splits import cli, write_splits
from times_problems import _bucket

SYSTEM_PROMPT = None
"""No system prompt of the task's own: the tool block is the system message (the Hermes fallback)."""

WORDINGS = ["What is {a} * {b}?", "Compute {a} * {b}.", "What is {a} times {b}?", "Multiply {a} by {b}.", "How much is {a} x {b}?"]
LOW_A, HIGH_A, LOW_B, HIGH_B = 100, 999, 11, 99


def call(name: str, arguments: dict) -> str:
    """A call as the Hermes format writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def worked(a: int, b: int) -> list[dict]:
    """A question, its calculator call, the result as the fallback returns it, and the answer."""
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": call("multiply", {"a": a, "b": b})},
        {"role": "user", "content": f"<tool_response>\n{a * b}\n</tool_response>"},
        {"role": "assistant", "content": str(a * b)},
    ]


WORKED = worked(12, 13) + worked(41, 27)
"""The worked calls every prompt starts with."""


def problems(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems, split by a hash of the question: (train, eval)."""
    r = random.Random(seed)
    train, eval_, seen = [], [], set()
    while len(train) < n_train or len(eval_) < n_eval:
        a, b = r.randint(LOW_A, HIGH_A), r.randint(LOW_B, HIGH_B)
        if r.random() < 0.5:
            a, b = b, a
        q = r.choice(WORDINGS).format(a=a, b=b)
        if q in seen:
            continue
        seen.add(q)
        split = eval_ if _bucket(q) == 0 else train
        if len(split) < (n_eval if split is eval_ else n_train):
            split.append({"prompt": [*WORKED, {"role": "user", "content": q}], "question": q, "answer": str(a * b)})
    return train, eval_


def write(out, n_train: int = 2000, n_eval: int = 100, seed: int = 0) -> tuple:
    """Write OUT/train.jsonl and OUT/eval.jsonl (same seed, same bytes)."""
    return write_splits(out, problems(n_train, n_eval, seed))


if __name__ == "__main__":
    cli(write, __doc__)
