"""TRL-style reward functions for the real-model demo (seed 002's format), loaded by path:

    rewards:
      - fn: examples/rewards.py:match_format_approximately

Each is fn(prompts, completions, **kwargs) -> list[float], as TRL's GRPOTrainer calls them:
completions[i] is [{"role": "assistant", "content": text}] for chat prompts, and every other
dataset column (here `answer`, the gold integer as text) arrives as a keyword argument. They
run unchanged under TRL (the README's calibration does exactly that).

Partial credit on purpose: with only all-or-nothing rewards a 135M model that writes good
working but no tags scores 0 on every sample and nothing is learned. So, as in Unsloth's GRPO
notebooks, each tag used once earns a little (match_format_approximately), and a correct
final number earns something even outside the tags (check_numbers).
"""

from __future__ import annotations

import re

REASONING_START, REASONING_END = "<start_working_out>", "<end_working_out>"
SOLUTION_START, SOLUTION_END = "<SOLUTION>", "</SOLUTION>"

MATCH_FORMAT = re.compile(
    rf"^\s*{re.escape(REASONING_START)}.+?{re.escape(REASONING_END)}\s*"
    rf"{re.escape(SOLUTION_START)}\s*(.+?)\s*{re.escape(SOLUTION_END)}\s*$",
    flags=re.DOTALL,
)
SOLUTION = re.compile(rf"{re.escape(SOLUTION_START)}\s*(.*?)\s*{re.escape(SOLUTION_END)}", flags=re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else str(completion)


def _number(text: str) -> float | None:
    found = NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def match_format_exactly(prompts, completions, **kwargs) -> list[float]:
    """3.0 when the whole completion is working in its tags followed by a solution in its tags."""
    return [3.0 if MATCH_FORMAT.search(_text(c)) else 0.0 for c in completions]


def match_format_approximately(prompts, completions, **kwargs) -> list[float]:
    """+0.5 for each of the four tags used exactly once, -0.5 for each used more than once."""
    scores = []
    for c in completions:
        text = _text(c)
        score = 0.0
        for tag in (REASONING_START, REASONING_END, SOLUTION_START, SOLUTION_END):
            n = text.count(tag)
            score += 0.5 if n == 1 else (-0.5 if n > 1 else 0.0)
        scores.append(score)
    return scores


def check_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """3.0 when the text between <SOLUTION> and </SOLUTION> is the gold answer, 1.5 when its
    number is (e.g. `$17` or `17 apples`), else 0."""
    scores = []
    for c, gold in zip(completions, answer):
        m = SOLUTION.search(_text(c))
        if m is None:
            scores.append(0.0)
        elif m.group(1).strip() == str(gold).strip():
            scores.append(3.0)
        elif _number(m.group(1)) == float(gold):
            scores.append(1.5)
        else:
            scores.append(0.0)
    return scores


def check_numbers(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number is the gold answer, tags or not (partial credit for
    getting the arithmetic right before getting the format right)."""
    return [1.0 if _number(_text(c)) == float(gold) else 0.0 for c, gold in zip(completions, answer)]


def last_number_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number is the gold answer (`6 * 7 = 42.`, `$42`), else 0.
    The times-table demo's only reward (examples/real.yaml): an answer cut off by the token
    limit, or buried before more talk, scores 0, so being right and brief is what pays."""
    return [1.0 if _number(_text(c)) == float(gold) else 0.0 for c, gold in zip(completions, answer)]


def final_answer_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the model's last message is the gold answer, else 0. The agent
    demo's reward (examples/agent.yaml): completions[i] is the episode's conversation (TRL 1.16's
    messages for tool episodes), and only what the model itself wrote counts, so a product the
    calculator returned pays only once the model has said it."""
    scores = []
    for c, gold in zip(completions, answer):
        said = [m.get("content") or "" for m in c if m.get("role") == "assistant"] if isinstance(c, list) else [str(c)]
        scores.append(1.0 if said and _number(said[-1]) == float(gold) else 0.0)
    return scores
