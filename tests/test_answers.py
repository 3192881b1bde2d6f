"""`correct` compares answers with math-verify: a golden table of gold / predicted pairs, equal
and unequal, each checked against math-verify itself, through `answers_match` and through the
`correct` built-in with GSM8K-style gold answers. The hand parser decides only where math-verify
reads nothing from one side (the documented fallback), and a test shows such a case."""

from __future__ import annotations

import threading

import pytest

from pipeline.config.errors import reward_spec
from pipeline.rewards.answers import answers_match, fallback_match
from pipeline.rewards.contract import compute_rewards

# (gold after ####, predicted answer block, equal?)
GOLDEN = [
    ("72", "72", True),
    ("72", "72.0", True),
    ("72", "73", False),
    ("1000", "1,000", True),  # thousands separator
    ("1,000", "1000", True),
    ("12,345,678", "12345678", True),
    ("1,234", "1243", False),
    ("0.5", "1/2", True),  # fraction
    ("1/2", "\\frac{1}{2}", True),  # LaTeX fraction, bare
    ("\\frac{3}{4}", "0.75", True),
    ("\\dfrac{7}{2}", "3.5", True),
    ("2/4", "1/2", True),
    ("1/3", "0.333", False),  # a rounded decimal is not the fraction
    ("-0.5", "-\\frac12", True),
    ("-3", "-3", True),
    ("3", "-3", False),
    ("50%", "50", True),  # percentages: math-verify accepts the number with or without %
    ("50%", "0.5", True),
    ("0.25", "25%", True),
    ("10%", "12%", False),
    ("3", "\\boxed{3}", True),  # boxed
    ("13", "The answer is \\boxed{13}", True),
    ("13", "\\boxed{31}", False),
    ("3", "$3$", True),  # inline math
    ("$1,234.50", "1234.5", True),  # a dollar amount
    ("2\\sqrt{2}", "\\sqrt{8}", True),  # symbolic LaTeX
    ("\\pi", "3.14159", False),
    ("42", "The final answer is 42.", True),
    ("10", "10 apples", True),
    ("x=5", "5", True),
    ("7", "7.5", False),
    ("6", "6.0001", False),
    ("100", "99.9999999", False),
]


def math_verify_says(gold: str, predicted: str) -> bool:
    from math_verify import parse, verify

    def read(text):  # as pipeline.rewards.answers does: a bare LaTeX answer is read as LaTeX
        if "\\" in text and not any(m in text for m in ("$", "\\boxed", "\\(", "\\[")):
            return parse(f"${text}$") or parse(text)
        return parse(text)

    return bool(verify(read(gold), read(predicted)))


@pytest.mark.parametrize("gold, predicted, equal", GOLDEN)
def test_the_golden_table_agrees_with_math_verify(gold, predicted, equal):
    assert len(GOLDEN) >= 30
    assert answers_match(predicted, gold) is equal
    assert math_verify_says(gold, predicted) is equal  # the table is math-verify's verdict, not ours


def test_the_correct_builtin_reads_gsm8k_gold_and_the_answer_block():
    completions = [f"<think>work</think><answer>{p}</answer>" for _, p, _ in GOLDEN]
    golds = [f"Some working.\n#### {g}" for g, _, _ in GOLDEN]
    rewards = compute_rewards([reward_spec({"fn": "correct"})], ["q"] * len(GOLDEN), completions, None, {"answer": golds}, iteration=0)
    assert rewards[:, 0].tolist() == [1.0 if equal else 0.0 for _, _, equal in GOLDEN]


def test_the_hand_parser_is_the_fallback_where_math_verify_reads_nothing():
    from math_verify import parse

    # GSM8K writes dollar amounts with an escaped dollar sign; math-verify extracts nothing from it
    assert parse("\\$18") == [] and not math_verify_says("18", "\\$18")
    assert answers_match("\\$18", "18") and fallback_match("\\$18", "18")
    assert not answers_match("\\$19", "18")
    assert not answers_match(None, "18") and not answers_match("18", None)


def test_it_works_off_the_main_thread_where_math_verify_has_no_alarm():
    results = []
    worker = threading.Thread(target=lambda: results.extend(answers_match(p, g) for g, p, _ in GOLDEN[:8]))
    worker.start()
    worker.join(timeout=60)
    assert results == [equal for _, _, equal in GOLDEN[:8]]
