"""The eval's intervals hold their 95 % where users use them (issue 54): a seeded simulation of every
interval `grpo eval` reports -- mean@k, pass@k, maj@k and a reward mean -- at 10, 30 and 100 prompts, with
rates near 0, near 1, at 0.5 and spread across prompts, and `--compare`'s test with no true difference.

The simulated eval: each prompt has a true rate p (fixed, or drawn from a Beta), 8 samples, each correct
with p; a wrong sample answers one of three wrong answers or nothing (a quarter of them); its reward is
correct + 0.5 x format, format a coin of 0.9. The figures are computed by the functions `grpo eval` uses
(pipeline/eval/stats.py), vectorised over 1000 simulated evals a case.

Why 1000 and 93 %: an interval that truly covers 95 % shows a share with standard error
sqrt(0.95 x 0.05 / 1000) = 0.0069, so 93 % is 2.9 standard errors below it (one case in 500 falls there
by chance; the simulation is seeded, so a pass is a pass every time), while an interval truly at 91 %
(the percentile bootstrap's 10-prompt figure) exceeds 93 % with chance 0.2 %.

`python tests/test_eval_intervals.py` prints the coverage table of docs/tracking.md (the candidates the
simulation compared, the chosen one among them)."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from pipeline.eval.stats import (Z95, effective_wilson, maj_at_k, pass_at_k, sign_flip_p, t975, tail_wilson, wilson)

N = 8  # samples a prompt
K = 4  # pass@4, maj@4
REPLICATES = 1000
REGIMES = {"p=0.02": (0.02, None), "p=0.5": (0.5, None), "p=0.98": (0.98, None),
           "Beta(0.2,2)": (0.2, 2.0), "Beta(2,0.2)": (2.0, 0.2)}


def rates(rng, regime: str, shape) -> np.ndarray:
    a, b = REGIMES[regime]
    return np.full(shape, a) if b is None else rng.beta(a, b, shape)


def draw(rng, regime: str, shape):
    """(correct [..., N] 0/1, answer cluster [..., N], reward [..., N]) of simulated prompts of `shape`."""
    p = rates(rng, regime, shape)[..., None]
    correct = rng.random((*shape, N)) < p
    wrong = rng.integers(1, 5, (*shape, N))  # 1-3: a wrong answer; 4: none
    answer = np.where(correct, 0, wrong)
    reward = correct + 0.5 * (rng.random((*shape, N)) < 0.9)
    return correct.astype(np.float64), answer, reward


def as_clusters(answer: np.ndarray) -> np.ndarray:
    """Answers as the cluster numbers pipeline/eval/stats.py's clusters gives: in order of first appearance."""
    first = np.argmax(answer[..., None, :] == answer[..., :, None], axis=-1)  # [..., N]: each answer's first sample
    # a cluster's number is the count of distinct answers whose first sample comes before its own
    starts = first == np.arange(answer.shape[-1])  # [..., N]
    return np.take_along_axis(np.cumsum(starts, axis=-1) - 1, first, axis=-1)


def pass_k(correct: np.ndarray, k: int) -> np.ndarray:
    c = correct.sum(axis=-1).astype(int)
    table = np.array([pass_at_k(N, j, k) for j in range(N + 1)])
    return table[c]


def per_prompt(correct, answer, reward) -> dict[str, np.ndarray]:
    """Each simulated prompt's figures, as pipeline/eval/metrics.py takes them."""
    return {"mean@8": correct.mean(axis=-1), "pass@1": pass_k(correct, 1), f"pass@{K}": pass_k(correct, K),
            f"maj@{K}": maj_at_k(as_clusters(answer), correct, K), "reward": reward.mean(axis=-1)}


def moment(regime: str, j: int, l: int) -> float:
    """E[p^j (1 - p)^l] over the regime's prompt rates (a Beta's moment, or the fixed rate's power)."""
    a, b = REGIMES[regime]
    if b is None:
        return a**j * (1 - a) ** l
    lb = math.lgamma  # B(a + j, b + l) / B(a, b)
    return math.exp(lb(a + j) + lb(b + l) - lb(a + b + j + l) - lb(a) - lb(b) + lb(a + b))


@functools.lru_cache(maxsize=None)
def maj_weights(k: int) -> dict[int, float]:
    """{j: w}: a prompt of rate p has maj@k = sum_j w_j p^j (1 - p)^(k - j), by enumerating the 5^k answer
    sequences of k samples (0 correct, 1-3 a wrong answer, 4 none: a quarter of a wrong sample's chance each)
    with stats.majority's rule (the largest answer; a tie: the one seen first; `[invalid]` one answer)."""
    out: dict[int, float] = {}
    for seq in itertools.product(range(5), repeat=k):
        counts = np.bincount(seq, minlength=5)
        if next(a for a in seq if counts[a] == counts.max()) == 0:
            j = seq.count(0)
            out[j] = out.get(j, 0.0) + 0.25 ** (k - j)
    return out


@functools.lru_cache(maxsize=None)
def truths(regime: str) -> dict[str, float]:
    """Each figure's true value, exact: every figure's per-prompt expectation is a polynomial in the prompt's
    rate p (mean@8 and pass@1: p; pass@k: 1 - (1 - p)^k, Chen et al.'s estimate being unbiased; maj@k: the
    same vote over k independent samples, maj_at_k's expectation over k-subsets being that; reward: p + 0.45),
    so its mean over prompts is a sum of the regime's moments."""
    p = moment(regime, 1, 0)
    return {"mean@8": p, "pass@1": p, f"pass@{K}": 1 - moment(regime, 0, K),
            f"maj@{K}": sum(w * moment(regime, j, K - j) for j, w in maj_weights(K).items()), "reward": p + 0.45}


def chosen(values: np.ndarray, figure: str) -> tuple[np.ndarray, np.ndarray]:
    """The interval pipeline/eval/stats.py's estimate gives, vectorised over records [R, m]: Wilson over
    prompts for a record whose values are all 0 or 1, else at each end the wider of the effective-n Wilson
    (on the samples over k for a k-sample figure, as metrics.draws says) and the generalised Wilson over
    prompts (a reward via its span)."""
    m = values.shape[-1]
    a, b = (0.0, 1.5) if figure == "reward" else (0.0, 1.0)
    x = (values - a) / (b - a)
    k = K if figure in (f"pass@{K}", f"maj@{K}") else 1
    lo, hi = effective_wilson(x, m * N / k)
    tlo, thi = tail_wilson(x)
    lo, hi = np.minimum(lo, tlo), np.maximum(hi, thi)
    share = np.all((values == 0) | (values == 1), axis=-1) & (figure != "reward")
    if share.any():
        w = np.array([wilson(s, m) for s in values[share].sum(axis=-1)])
        lo[share], hi[share] = w[:, 0], w[:, 1]
    return a + (b - a) * lo, a + (b - a) * hi


def coverage(regime: str, m: int, interval=chosen, seed: int = 54) -> dict[str, float]:
    rng = np.random.default_rng([seed, m, list(REGIMES).index(regime)])
    figures = per_prompt(*draw(rng, regime, (REPLICATES, m)))
    truth = truths(regime)
    out = {}
    for f, v in figures.items():
        lo, hi = interval(v, f)
        out[f] = float(np.mean((lo <= truth[f] + 1e-12) & (truth[f] - 1e-12 <= hi)))
    return out


@pytest.mark.parametrize("m", [10, 30, 100])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_every_eval_interval_covers_at_least_93_percent(regime, m):
    cov = coverage(regime, m)
    assert min(cov.values()) >= 0.93, cov


def test_the_chosen_interval_is_the_one_estimate_gives():
    """`chosen` (the simulation's vectorised interval) is pipeline/eval/stats.py's estimate, record by record."""
    from pipeline.eval.stats import estimate

    rng = np.random.default_rng(3)
    for regime in REGIMES:
        figs = per_prompt(*draw(rng, regime, (5, 10)))
        for f, v in figs.items():
            lo, hi = chosen(v, f)
            for r in range(5):
                span = (0.0, 1.5) if f == "reward" else None
                k = K if f in (f"pass@{K}", f"maj@{K}") else 1
                want = estimate(v[r], rate=f != "reward", samples=10 * N / k, span=span)
                assert (lo[r], hi[r]) == pytest.approx(want[1:], abs=1e-12), (regime, f, r)


def test_ten_prompts_each_four_of_eight_get_an_interval_of_the_80_samples_and_of_the_10_prompts():
    """s^2 = 0 between prompts. The effective-n Wilson: the variance is the samples' own, n_eff = 80, the score
    interval of 40 of 80 with t(9) = 2.2622: half = 2.2622 sqrt(0.25/80 + 2.2622^2/25600) / (1 + 2.2622^2/80)
    = 0.1226. The generalised Wilson over the 10 prompts: d^2 = (z^2/10) d (0.5 - d), d = 0.5 c / (1 + c) with
    c = z^2 / 10 = 0.38415: 0.1388, wider, so estimate gives it (a tail of prompts the ten did not show)."""
    from pipeline.eval.stats import estimate

    z = 2.2622
    half = z * np.sqrt(0.25 / 80 + z * z / (4 * 80 * 80)) / (1 + z * z / 80)
    lo, hi = effective_wilson(np.full(10, 0.5), 80)
    assert (float(lo), float(hi)) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-4)
    assert half == pytest.approx(0.1226, abs=1e-4)
    c = Z95**2 / 10
    d = 0.5 * c / (1 + c)
    assert d == pytest.approx(0.1388, abs=1e-4)
    assert estimate([0.5] * 10, samples=80) == pytest.approx((0.5, 0.5 - d, 0.5 + d), abs=1e-12)


def test_the_generalised_wilson_is_wilson_on_shares():
    """tail_wilson on 0/1 values is Wilson's interval over the prompts, exactly (its variance at p0 is p0 (1 - p0))."""
    rng = np.random.default_rng(4)
    x = (rng.random((50, 12)) < rng.random((50, 1))).astype(np.float64)
    lo, hi = tail_wilson(x)
    want = np.array([wilson(s, 12) for s in x.sum(axis=-1)])
    assert np.allclose(lo, want[:, 0], atol=1e-12) and np.allclose(hi, want[:, 1], atol=1e-12)


def test_t_quantile_against_its_table_values():
    # Student's t 97.5 % quantiles (any table): df 1 12.706, 9 2.262, 10 2.228, 29 2.045, 99 1.984, large -> z
    for df, q in [(1, 12.706), (9, 2.262), (10, 2.228), (29, 2.045), (99, 1.984), (10**6, Z95)]:
        assert t975(df) == pytest.approx(q, abs=2e-3), df


@pytest.mark.parametrize("m", [10, 30, 100])
@pytest.mark.parametrize("regime", ["p=0.5", "Beta(0.2,2)", "p=0.02"])
def test_compare_with_no_true_difference_is_distinguishable_at_most_5_percent(regime, m):
    """Two records of the same policy (each prompt's rate shared, the samples drawn anew): the sign-flip test
    rejects at 5 % in at most 5 % of them. An exact test's size is at most its level, but at 30 and 100
    prompts it sits close to it (measured with 4000 records: 0.041, 0.041 at p = 0.5; 0.048 at Beta(0.2, 2)
    and 100 prompts), so 1000 records (standard error 0.007) would cross 0.05 by chance; 4000 records
    (0.0034) keep this seeded draw below it, and the cost is small (the differences are plain arrays)."""
    rng = np.random.default_rng([55, m])
    R = 4000
    p = rates(rng, regime, (R, m))[..., None]
    a = (rng.random((R, m, N)) < p).mean(axis=-1)
    b = (rng.random((R, m, N)) < p).mean(axis=-1)
    rejected = np.mean(sign_flip_p(b - a) <= 0.05)
    assert rejected <= 0.05, rejected


def test_sign_flip_is_the_sign_test_on_wins_and_losses():
    # 4 of 30 prompts won, none lost: every flip of the 4 is equally likely; |sum| = 4 in 2 of 16: p = 0.125
    d = np.array([1.0] * 4 + [0.0] * 26)
    assert sign_flip_p(d)[0] == pytest.approx(0.125, abs=1e-12)
    # 6 of 6 won: 2 / 64 = 0.03125, the exact two-sided sign test's p
    assert sign_flip_p(np.ones(6))[0] == pytest.approx(2 / 64, abs=1e-12)
    # 20 won, none lost (above the exact limit: seeded draws): 2 / 2^20 exactly, drawn: (1 + hits) / (1 + draws)
    p = sign_flip_p(np.ones(20))[0]
    assert p < 0.001 and p == sign_flip_p(np.ones(20))[0]


# -- the candidates the simulation compared (docs/tracking.md's table) ---------------------------------------

def _percentile(values, figure, resamples=2000):
    rng = np.random.default_rng(0)
    R, m = values.shape
    idx = rng.integers(0, m, (resamples, m))
    means = values[:, idx].mean(axis=-1)  # [R, B]
    return np.quantile(means, 0.025, axis=-1), np.quantile(means, 0.975, axis=-1)


def _t_interval(values, figure):
    m = values.shape[-1]
    mean, se = values.mean(-1), values.std(-1, ddof=1) / np.sqrt(m)
    return mean - t975(m - 1) * se, mean + t975(m - 1) * se


def _effective_t(values, figure):
    """The effective-n Wilson with t alone, on all the samples (the interval before the tail guard)."""
    m = values.shape[-1]
    a, b = (0.0, 1.5) if figure == "reward" else (0.0, 1.0)
    lo, hi = effective_wilson((values - a) / (b - a), m * N)
    share = np.all((values == 0) | (values == 1), axis=-1) & (figure != "reward")
    if share.any():
        w = np.array([wilson(s, m) for s in values[share].sum(axis=-1)])
        lo[share], hi[share] = w[:, 0], w[:, 1]
    return a + (b - a) * lo, a + (b - a) * hi


def _tail(values, figure):
    a, b = (0.0, 1.5) if figure == "reward" else (0.0, 1.0)
    lo, hi = tail_wilson((values - a) / (b - a))
    return a + (b - a) * lo, a + (b - a) * hi


CANDIDATES = {"percentile bootstrap": _percentile, "t over prompt means": _t_interval,
              "effective-n Wilson, t": _effective_t, "generalised Wilson over prompts": _tail,
              "wider of effective-n Wilson (samples / k) and generalised Wilson (chosen)": chosen}


if __name__ == "__main__":
    import sys

    REPLICATES = int(sys.argv[1]) if len(sys.argv) > 1 else REPLICATES  # docs/tracking.md's table: 2000
    for name, fn in CANDIDATES.items():
        print(f"\n{name}")
        for regime in REGIMES:
            for m in (10, 30, 100):
                cov = coverage(regime, m, fn)
                print(f"| {regime} | {m} | " + " | ".join(f"{c:.3f}" for c in cov.values()) + " |")
