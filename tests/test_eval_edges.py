"""Edge cases of the eval's estimators and settings (a review of issue 45 against HumanEval's
`estimate_pass_at_k`, lm-evaluation-harness's maj@k and Wilson's closed form at p = 0 and p = 1)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from test_eval import A, _record, cfg_of

from pipeline.errors import GRPOError
from pipeline.eval.intervals import Z95, clopper_pearson, estimate, paired, wilson
from pipeline.eval.metrics import figures
from pipeline.eval.stats import majority, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 1024])
def test_pass_at_k_at_its_edges_against_exact_binomials(n):
    for c in sorted({0, 1, n // 3, n - 1, n}):
        for k in sorted({1, 3, n // 3 or 1, n - 1 or 1, n} & set(range(1, n + 1))):
            # 1 - C(n-c, k) / C(n, k) in exact integers; math.comb(n-c, k) is 0 when n - c < k -> 1.0
            exact = 1 - math.comb(n - c, k) / math.comb(n, k) if c <= n else None
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-9), (n, c, k)
    assert pass_at_k(n, 0, n) == 0.0 and pass_at_k(n, n, n) == 1.0  # k == n: 0 without a hit, 1 with all
    assert pass_at_k(n, 1, n) == 1.0  # k == n, c == 1: the only n-subset holds the hit (n - c < k)


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 0, 0), (5, 0, 6), (0, 0, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_pass_and_maj_at_k_when_k_does_not_divide_n():
    # n=5, k=2, prompt 0 correct [0,1,0,0,1] (c=2): 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7; answers 3,4,3,3,4:
    # maj@2 over the 10 pairs: a pair of 4s (1,4) right, of 3s wrong; a mixed pair ties and its first sample
    # wins: (1,2), (1,3) right, (0,1), (0,4), (2,4), (3,4) wrong -> 3/10; prompt 1 all wrong: 0 and 0
    cfg = cfg_of(samples=5, greedy=False, pass_k=[2])
    rows = [(0, j, A(a), c) for j, (a, c) in enumerate(zip("34334", (0, 1, 0, 0, 1)))] + \
           [(1, j, A("9"), 0) for j in range(5)]
    f = figures(cfg, _record(rows))
    assert f["pass_at_2"][0] == pytest.approx(0.35)  # (0.7 + 0) / 2
    assert f["maj_at_2"][0] == pytest.approx(0.15)  # (0.3 + 0) / 2


def test_wilson_at_p0_and_p1_is_the_closed_form():
    for n in (1, 10, 200):
        # p = 0: [0, z^2 / (n + z^2)]; p = 1: [n / (n + z^2), 1]: exactly 1, not 1 - 1e-16
        assert wilson(0, n) == (0.0, pytest.approx(Z95**2 / (n + Z95**2), abs=1e-15))
        assert wilson(n, n) == (pytest.approx(n / (n + Z95**2), abs=1e-15), 1.0)
        lo, hi = wilson(0.5 * n, n)
        assert lo < 0.5 < hi and lo == pytest.approx(1 - hi)  # symmetric about 1/2


def test_one_prompt_gets_no_interval():
    """One prompt has no spread to resample: the interval is NaN, not [x, x] (zero width, false certainty)."""
    v, lo, hi = estimate([0.5])
    assert v == 0.5 and math.isnan(lo) and math.isnan(hi)
    assert estimate([1.0]) == (1.0, 0.025, 1.0)  # a share of one prompt still has Clopper-Pearson's interval
    d, lo, hi = paired([0.0], [1.0])
    assert d == 1.0 and math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("m", [6, 10, 30])
def test_the_compare_interval_agrees_with_the_verdict_and_covers_the_true_shift(m):
    """Seeded simulation at the sizes users compare (6, 10, 30 prompts): per-prompt differences of two
    records of 8 samples a prompt (shares c/8, each side's rate drawn around a common one, B shifted by
    a true difference). The interval (the mean difference's, widened to hold 0 where the test does not reject)
    leaves out 0 exactly when p <= 0.05, in every record; and it holds the true difference in at least 93 % of them (a
    percentile bootstrap over 10 prompts held it in about 88 %)."""
    from pipeline.eval.intervals import sign_flip_p

    rng = np.random.default_rng(54 + m)
    records, held = 300, 0
    for i in range(records):
        shift = (0.0, 0.1, 0.25)[i % 3]
        rate = rng.uniform(0.2, 0.7, m)
        a = rng.binomial(8, rate) / 8
        b = rng.binomial(8, np.clip(rate + shift, 0, 1)) / 8
        d, lo, hi = paired(a, b, span=(0.0, 1.0), samples=2 * 8 * m)
        p = float(sign_flip_p(b - a)[0])
        assert (p <= 0.05) == (not lo <= 0 <= hi), (i, p, lo, hi)
        held += lo <= np.mean(np.clip(rate + shift, 0, 1) - rate) <= hi
    assert held / records >= 0.93, held / records


def test_compare_of_one_prompt_is_not_called_distinguishable():
    from pipeline.eval.compare import compare, verdict

    side = lambda name: SimpleNamespace(cfg=cfg_of(), store=SimpleNamespace(display=lambda: name))  # noqa: E731
    a = _record([(0, 0, A("1"), 0)]).drop_columns(["sample_idx"])
    b = _record([(0, 0, A("1"), 1)]).drop_columns(["sample_idx"])
    line = verdict(compare(side("A"), 0, a, side("B"), 0, b))
    assert line.endswith("no interval (one prompt); not distinguishable from noise"), line


def test_a_count_that_is_one_everywhere_is_not_a_share():
    """episodes/turns_mean of 1 on every prompt: a mean, not a share (Clopper-Pearson would say [0.83, 1]), and
    not [1, 1] either: nothing declares its range, so it is the samples' own, widened ([0, 2]), and a turn
    count of 2 on prompts the 20 did not show would move the truth (issue 64)."""
    v, lo, hi = estimate([1.0] * 20, rate=False)
    assert v == 1.0 and lo < 1.0 < hi and lo >= 0.0 and hi <= 2.0
    cfg = cfg_of()
    rows = [(i, 0, A("1"), i % 2) for i in range(20)]
    t = _record(rows).drop_columns(["sample_idx"])
    t = t.set_column(t.column_names.index("reward_format"), "reward_format", pa.array([1.0] * 20))
    f = figures(cfg, t)
    # the format reward declares [0, 1]: every sample at its top, var = 0, so the effective-n interval is
    # Clopper-Pearson's of 20 of 20 (lower end 0.025^(1/20) = 0.832), wider than the generalised Wilson's 0.839
    assert f["rewards/format"] == pytest.approx((1.0, 0.025 ** (1 / 20), 1.0))
    assert f["accuracy"] == pytest.approx((0.5, *clopper_pearson(10, 20)))  # a share: Clopper-Pearson


def test_clopper_pearson_is_the_exact_binomial_inversion():
    """Its ends are the shares at which the binomial tail at the count seen is 2.5 %: at 0 and n the closed
    forms 1 - 0.025^(1/n) and 0.025^(1/n), and between them P(X >= x | lo) = P(X <= x | hi) = 0.025."""
    from scipy import stats

    for n in (1, 3, 5, 100):
        assert clopper_pearson(0, n) == (0.0, pytest.approx(1 - 0.025 ** (1 / n), abs=1e-12))
        assert clopper_pearson(n, n) == (pytest.approx(0.025 ** (1 / n), abs=1e-12), 1.0)
    for x, n in ((1, 5), (4, 5), (1, 100), (37, 80)):
        lo, hi = clopper_pearson(x, n)
        assert stats.binom.sf(x - 1, n, lo) == pytest.approx(0.025, abs=1e-9)
        assert stats.binom.cdf(x, n, hi) == pytest.approx(0.025, abs=1e-9)
    # Wilson's (4 of 5) upper end 0.964 leaves out a true 0.972 that Clopper-Pearson holds (issue 64's dip)
    assert wilson(4, 5)[1] < 0.972 < clopper_pearson(4, 5)[1]
    assert clopper_pearson(1, 100)[0] < 0.001 < wilson(1, 100)[0]  # a rare rate seen once: its lower end


def test_a_prompt_whose_rewards_are_all_none():
    """The accuracy reward None on every sample: not a hit (accuracy, pass@k, maj@k count it as 0), while the
    reward means leave it out (NaN: no reward applied)."""
    cfg = cfg_of(samples=2, greedy=False, pass_k=[1, 2])
    t = _record([(0, 0, A("1"), 1), (0, 1, A("1"), 1), (1, 0, A("2"), 0), (1, 1, A("2"), 0)])
    none = pa.array([1.0, 1.0, None, None], pa.float64())
    t = t.set_column(t.column_names.index("reward"), "reward", none)
    t = t.set_column(t.column_names.index("reward_correct"), "reward_correct", none)
    f = figures(cfg, t)
    assert f["accuracy"][0] == 0.5 and f["pass_at_2"][0] == 0.5 and f["maj_at_2"][0] == 0.5
    assert f["reward"][0] == 1.0 and math.isnan(f["reward"][1])  # one prompt with a reward: no interval


def test_majority_ties_and_math_equivalences():
    from pipeline.rewards.answers import answers_match

    same = lambda a, b: a == b  # noqa: E731
    # a tie goes to the answer seen first, whatever the order of the rest (deterministic, as Counter.most_common)
    assert majority(["a", "b"], same) == 0 and majority(["b", "a", "a", "b"], same) == 0
    assert majority([None, "b", "a"], same) == 0 and majority([None, None], same) == 0  # [invalid] is an answer
    # "1/2", "0.5" and "\frac{1}{2}" are one answer to math-verify: 3 votes beat 2 for "0.25"
    answers = ["0.25", "1/2", "0.25", "0.5", "\\frac{1}{2}"]
    assert majority(answers, answers_match) == 1
    assert majority(answers, same) == 0  # as exact text, "0.25" would win


@pytest.mark.parametrize("name", [".", "..", "pass_at_4", "maj_at_1", "accuracy_lo", "reward_hi", "mean_length"])
def test_eval_set_names_that_clash_with_a_metric_are_refused(name):
    from pipeline.config import resolve

    tree = {"model": "m", "data": {"train": "t.jsonl", "eval": {name: "e.jsonl"}}, "rewards": [{"fn": "correct"}]}
    with pytest.raises(GRPOError, match=rf"data\.eval\.{re.escape(name)}: an eval set's name is a metric path segment"):
        resolve(tree)


def test_odd_but_fine_eval_set_names_are_kept():
    from pipeline.config import resolve

    for name in ("gsm8k.test", "pass_at_k", "accuracy2", "a-b_c", "...x"):
        tree = {"model": "m", "data": {"train": "t.jsonl", "eval": {name: "e.jsonl"}}, "rewards": [{"fn": "correct"}]}
        assert resolve(tree).eval_sets()[0].name == name


def test_a_named_eval_set_whose_file_is_missing_fails_preflight_in_one_line(tmp_path):
    from pipeline import preflight
    from pipeline.config import resolve

    (tmp_path / "t.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
    (tmp_path / "a.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
    tree = {"model": "m", "data": {"train": str(tmp_path / "t.jsonl"),
                                   "eval": {"easy": str(tmp_path / "a.jsonl"), "hard": str(tmp_path / "gone.jsonl")}},
            "rewards": [{"fn": "correct"}]}
    with pytest.raises(GRPOError) as err:
        preflight.check(resolve(tree))
    assert str(err.value).startswith("data.eval.hard: ") and "gone.jsonl" in str(err.value) and "\n" not in str(err.value)




def test_compare_says_when_the_sides_count_accuracy_with_different_rewards():
    """A --replay with eval.reward=format against its source: the same completions, another grader; --compare
    says so above its verdict (the difference is the graders' as much as the policies')."""
    from pipeline.eval.compare import compare, lines

    side = lambda name, cfg: SimpleNamespace(cfg=cfg, store=SimpleNamespace(display=lambda: name))  # noqa: E731
    t = _record([(i, 0, A("1"), i % 2) for i in range(6)]).drop_columns(["sample_idx"])
    out = lines(compare(side("A", cfg_of()), 0, t, side("B", cfg_of(reward="format")), 0, t))
    assert out[-2] == "note: set eval: A counts accuracy with reward 'correct', B with 'format'"
    assert not any(line.startswith("note:") for line in lines(compare(side("A", cfg_of()), 0, t, side("B", cfg_of()), 0, t)))


def test_majority_of_many_distinct_answers_asks_math_verify_only_where_the_key_cannot_say():
    """1024 samples, every answer a different integer: math-verify is never asked (it was asked 523,776
    times, about 5 minutes a prompt); an answer that is no plain integer still clusters with one by math-verify."""
    from pipeline.eval.metrics import integer_key
    from pipeline.rewards.answers import answers_match

    calls = []

    def same(a, b):
        calls.append((a, b))
        return answers_match(a, b)

    answers = [str(i) for i in range(1024)]
    assert majority(answers, same, integer_key) == 0 and calls == []
    # "2.0", "\frac{4}{2}" and "2" are one answer (3 votes) against "7" (2 votes): the math-verify path
    assert majority(["7", "2.0", "7", "\\frac{4}{2}", "2"], same, integer_key) == 1
    assert majority(["7", "2.0", "7", "\\frac{4}{2}", "2"], same) == 1  # the same without the key
    # the key agrees with math-verify on plain integers (signs, leading zeros)
    for a, b in [("7", "007"), ("-3", "3"), ("0", "-0"), ("12", "21"), ("100", "1e2")]:
        ka, kb = integer_key(a), integer_key(b)
        if ka is not None and kb is not None:
            assert (ka == kb) == answers_match(a, b), (a, b)


def _naive_maj(labels, hits, k):
    """maj@k by the definition: every k-subset in order, its votes counted, a tie to the first in the subset."""
    import itertools

    got = []
    for sub in itertools.combinations(range(len(labels)), k):
        votes = [labels[i] for i in sub]
        top = max(votes.count(x) for x in votes)
        got.append(hits[next(i for i in sub if votes.count(labels[i]) == top)])
    return sum(got) / len(got)


def test_maj_at_k_is_its_expectation_over_k_subsets():
    import numpy as np

    from pipeline.eval.stats import maj_at_k

    rng = np.random.default_rng(5)
    for n, k in [(1, 1), (5, 2), (8, 3), (8, 8), (12, 6)]:  # C(12, 6) = 924: exact
        for _ in range(5):
            labels = np.unique(rng.integers(0, 4, n), return_inverse=True)[1]  # any numbering < n
            hits = (labels == 0).astype(float)
            assert maj_at_k(labels, hits, k) == pytest.approx(_naive_maj(list(labels), list(hits), k), abs=1e-12)
    # C(16, 8) = 12870 > 5000: 5000 seeded subsets, within 0.03 (the share's standard error is at most 0.007)
    labels = np.array([0, 1, 2, 0, 1, 0, 2, 3, 0, 1, 1, 0, 2, 1, 0, 3])
    hits = (labels == 0).astype(float)
    got = maj_at_k(labels, hits, 8)
    assert got == maj_at_k(labels, hits, 8) and got == pytest.approx(_naive_maj(list(labels), list(hits), 8), abs=0.03)


def test_unanswered_samples_vote_invalid_and_maj_at_1_is_pass_at_1():
    """4 unanswered samples and a 2:2 tie (issue 54): [invalid] has 4 votes and wins, so maj@8 is 0 (it counted
    as correct when they abstained); maj@1 is the share correct, pass@1, on the same record."""
    cfg = cfg_of(samples=8, greedy=False, pass_k=[1, 8])
    answers = ["5", None, "7", None, "5", None, "7", None]
    rows = [(0, j, A(a) if a else "no answer here", a == "5") for j, a in enumerate(answers)]
    rows += [(1, j, A("5"), j < 3) for j in range(8)]  # prompt 1: 8 answers "5", 3 marked correct
    f = figures(cfg, _record(rows))
    # prompt 1: all one cluster; a subset's majority is its first sample -> maj@8 = hit of sample 0 = 1
    assert f["maj_at_8"][0] == pytest.approx((0 + 1) / 2)
    assert f["maj_at_1"][0] == pytest.approx(f["pass_at_1"][0], abs=1e-12) == pytest.approx((2 / 8 + 3 / 8) / 2)


def test_a_figure_s_span_is_the_range_it_can_take():
    """metrics.span: a rate [0, 1]; a length [0, rollout.max_new_tokens]; the reward the sum of its rewards'
    declared ranges times their weights (`correct` [0, 1] + 0.5 x `format` [0, 1]: [0, 1.5]); a reward nobody
    declares a range for (your own function) its samples' range widened; every figure at least what it took."""
    from pipeline.eval.metrics import declared, declared_span, per_prompt, span

    cfg = cfg_of()
    rows = [(i, 0, A("1"), 1) for i in range(6)]  # every sample right and well formatted: reward 1.0 + 0.5 x 1.0
    t = _record(rows).drop_columns(["sample_idx"])
    t = t.set_column(t.column_names.index("reward_format"), "reward_format", pa.array([1.0] * 6))
    t = t.set_column(t.column_names.index("completion_length"), "completion_length", pa.array([64] * 6))
    values = per_prompt(cfg, t)
    assert span(cfg, values, "accuracy") == (0.0, 1.0)
    assert span(cfg, values, "mean_length") == (0.0, 64.0) == declared_span(cfg, "mean_length")  # all at the cap
    assert span(cfg, values, "reward") == (0.0, 1.5) and span(cfg, values, "rewards/format") == (0.0, 1.0)
    f = figures(cfg, t)
    assert f["mean_length"][0] == f["mean_length"][2] == 64.0 and f["mean_length"][1] < 64.0  # not [64, 64]
    from pipeline.config import Config

    custom = Config.model_validate({"model": "m", "data": {"train": "t.jsonl", "eval": "e.jsonl"},
                                    "rewards": [{"fn": "correct"}, {"fn": "my_rewards.py:score", "name": "format"}]})
    assert declared(custom.rewards[1]) is None and declared_span(custom, "reward") is None
    assert span(custom, values, "rewards/format") == (0.0, 2.0)  # all at 1.0, widened by 1 on each side
    ranged = Config.model_validate({"model": "m", "data": {"train": "t.jsonl", "eval": "e.jsonl"}, "rewards": [
        {"fn": "correct"}, {"fn": "my_rewards.py:score", "name": "format", "weight": 0.5, "range": [-1, 1]}]})
    assert declared(ranged.rewards[1]) == (-1.0, 1.0)  # your own function's declared range: no widening
    assert span(ranged, values, "rewards/format") == (-1.0, 1.0) and declared_span(ranged, "reward") == (-0.5, 1.5)
    overlong = Config.model_validate({"model": "m", "data": {"train": "t.jsonl", "eval": "e.jsonl"}, "rewards": [
        {"fn": "overlong", "kwargs": {"max_tokens": 8, "buffer": 4}, "weight": 2.0}, {"fn": "contains", "kwargs": {"keyword": "x", "value": -3}},
        {"fn": "correct", "weight": -1.0}]})
    assert declared_span(overlong, "reward") == (-6.0, 0.0)  # 2 x [-1, 0] + [-3, 0] - [0, 1]
