"""Answer conventions of the demo task (GSM8K style), shared by the rewards and the model builder.

Dataset rows carry `answer` as GSM8K does: the working, then `#### <number>`. Answers are
compared with math-verify (`answers_match`), the hand parser being only its fallback.
Completions are asked to put their working between <think> tags and the final answer between
<answer> tags: `<think>3 + 4 = 7</think><answer>7</answer>`.
"""

import functools
import re
import threading

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


MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own limit per parse / comparison. It is a SIGALRM, which only works in the
main thread; elsewhere (a reward function called from a worker thread) math-verify runs
without a limit, and the texts are capped at MAX_CHARS so a pathological one stays cheap."""
MAX_CHARS = 2000


@functools.cache
def _warm() -> None:
    """math-verify builds its LaTeX grammar and imports sympy on first use: do that once without
    the alarm, so a busy machine's slow first call is not taken for a pathological answer."""
    import logging

    from math_verify import parse, verify

    # it warns on every call made without its alarm (this one, and every call off the main
    # thread); the texts are capped at MAX_CHARS instead, as the module says
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify(parse("$\\frac{1}{2}$", parsing_timeout=None), parse("0.5", parsing_timeout=None), timeout_seconds=None)


@functools.lru_cache(maxsize=4096)  # gold answers repeat G times per group
def _parse(text: str, timeout: int | None) -> list:
    """math-verify's parse; a bare LaTeX answer (`\\frac{1}{2}`, no $ or \\boxed) is read as LaTeX."""
    from math_verify import parse

    _warm()

    text = text[:MAX_CHARS]
    if "\\" in text and not any(m in text for m in ("$", "\\boxed", "\\(", "\\[")):
        found = parse(f"${text}$", parsing_timeout=timeout)
        if found:
            return found
    return parse(text, parsing_timeout=timeout)


def to_number(text: str | None) -> float | None:
    """First number in `text` (thousands separators allowed), or None. The fallback parser."""
    if text is None:
        return None
    m = _NUMBER.search(text)
    if not m:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def fallback_match(predicted: str, gold: str) -> bool:
    """The hand parser: numeric comparison when both parse as numbers, else exact strings."""
    p, g = to_number(predicted), to_number(gold)
    if p is not None and g is not None:
        return abs(p - g) <= 1e-6 * max(1.0, abs(g))
    return predicted.strip() == gold.strip()


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """Gold vs predicted with Hugging Face's math-verify (as TRL's accuracy reward): numbers,
    fractions, percentages, thousands separators, \\boxed{} and LaTeX compare by value.

    Fallback (documented in docs/rewards.md): when math-verify extracts nothing from one side, the
    hand parser decides. The case that needs it: GSM8K-style escaped dollars, `\\$18`, which
    math-verify does not read at all, while "18" is plainly the answer.
    """
    if predicted is None or gold is None:
        return False
    from math_verify import verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    g, p = _parse(gold, timeout), _parse(predicted, timeout)
    if g and p:
        return bool(verify(g, p, timeout_seconds=timeout))
    return fallback_match(predicted, gold)
