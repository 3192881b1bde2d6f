"""Answer conventions of the demo task (GSM8K style), shared by the rewards and the model builder.

Dataset rows carry `answer` as GSM8K does: the working, then `#### <number>`.
Completions are asked to put their working between <think> tags and the final answer between
<answer> tags: `<think>3 + 4 = 7</think><answer>7</answer>`.
"""

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

_GOLD = re.compile(r"####\s*(.+?)\s*$", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_gold(answer: str) -> str | None:
    """The reference answer after `####` (GSM8K convention), or None."""
    m = _GOLD.search(answer or "")
    return m.group(1).strip() if m else None


def extract_answer(completion: str) -> str | None:
    """The text of the last <answer>...</answer> block of a completion, or None."""
    found = _ANSWER.findall(completion or "")
    return found[-1].strip() if found else None


def follows_format(completion: str) -> bool:
    """True when the completion is exactly <think>...</think><answer>...</answer>."""
    return bool(_FORMAT.match(completion or ""))


def to_number(text: str | None) -> float | None:
    """First number in `text` (thousands separators allowed), or None."""
    if text is None:
        return None
    m = _NUMBER.search(text)
    if not m:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """Numeric comparison when both parse as numbers, else exact string comparison."""
    if predicted is None or gold is None:
        return False
    p, g = to_number(predicted), to_number(gold)
    if p is not None and g is not None:
        return abs(p - g) <= 1e-6 * max(1.0, abs(g))
    return predicted.strip() == gold.strip()
