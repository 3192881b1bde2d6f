"""Cases on the rewards' side: from what the reward functions return to the advantages.

The implementation each experiment asks is a `Scorer`: `advantages(per_function [N, F], weights [F], G)`
-> A [N], and `contract(values)` -> the float64 column one reward function's output is stored as.
grpo's is its score stage's own path (`combine_rewards` then `advantages_of`, and the reward contract's
`compute_rewards`); the broken ones are the peers' bugs rebuilt on the same inputs.
"""

from __future__ import annotations

import numpy as np

from pipeline.conformance.case import Case
from pipeline.conformance.impls import Scorer

EPS = 1e-4  # grpo's default advantages.eps (and TRL's 1e-4)


def _grpo_contract(values: list) -> np.ndarray:
    """One reward function's output as grpo's score stage stores it: through `compute_rewards`."""
    from pipeline.config.rewards import CustomReward
    from pipeline.rewards.contract import compute_rewards

    texts = [str(v) for v in values]  # outcome_only reads the texts
    spec = CustomReward(fn="pipeline.conformance.impls:outcome_only")
    return compute_rewards([spec], ["q"] * len(texts), texts, None, {}, iteration=0)[:, 0]


def grpo_scorer() -> Scorer:
    from pipeline.config.advantages import AdvantageConfig
    from pipeline.objective.advantages import advantages_of, combine_rewards

    cfg = AdvantageConfig()
    return Scorer(lambda per_fn, w, G: advantages_of(cfg, combine_rewards(per_fn, w), G), _grpo_contract)


def _plain_group_advantages(total: np.ndarray, G: int) -> np.ndarray:
    """(r - mean) / (std + eps) per group with plain mean / sample std: a NaN spreads to its group."""
    g = total.reshape(-1, G)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + EPS)).reshape(-1)


def nansum_scorer() -> Scorer:
    """TRL before #5775's question: the weighted nansum over functions, so an all-None row totals 0.0."""
    def adv(per_fn, w, G):
        total = np.nansum(per_fn * w[None, :], axis=1)
        return _plain_group_advantages(total, G)
    return Scorer(adv, _grpo_contract)


def gdpo_scorer() -> Scorer:
    """ms-swift #8123: each function normalised in its group by plain mean / std, then summed: one None
    (NaN) makes its whole group's advantages NaN."""
    def adv(per_fn, w, G):
        parts = [_plain_group_advantages(per_fn[:, j], G) * w[j] for j in range(per_fn.shape[1])]
        return np.sum(parts, axis=0)
    return Scorer(adv, _grpo_contract)


def zero_default_scorer() -> Scorer:
    """TRL #6427: an unscored rollout's reward left at its default 0.0, a real reward to the group."""
    base = grpo_scorer()
    return Scorer(base.advantages, lambda values: np.nan_to_num(_grpo_contract(values), nan=0.0))


# --------------------------------------------------------------------------- experiments

def all_none_experiment(s: Scorer) -> tuple[bool, str]:
    # one group of G = 4, two functions, weights [1, 1]; row 2: every function returned None
    per_fn = np.array([[1.0, np.nan], [0.0, np.nan], [np.nan, np.nan], [0.5, np.nan]])
    A = s.advantages(per_fn, np.ones(2), 4)
    # expected: row 2 left out: valid rewards {1, 0, 0.5}, mean 0.5, sample std
    #   sqrt((0.25 + 0.25 + 0) / 2) = 0.5, so A = [0.5, -0.5, 0, 0] / (0.5 + 1e-4) = [0.9998, -0.9998, 0, 0]
    want = np.array([0.5, -0.5, 0.0, 0.0]) / (0.5 + EPS)
    err = float(np.nanmax(np.abs(A - want))) if np.isfinite(A).all() else float("inf")
    return bool(A[2] == 0.0 and err < 1e-6), f"A(all-None row) = {A[2]:.4g}, max |A - expected| = {err:.3g}"


def one_nan_experiment(s) -> tuple[bool, str]:
    """G = 4, functions (correct, format); the format function returned None on row 1 only. What the thread
    (ms-swift #8123, GDPO) is about: every advantage finite, whatever the aggregation, and the rows that
    have values normalised among themselves under the implementation's own aggregation. Either way (sum
    then normalise, or normalise each function then sum) the group's advantages sum to 0 and the fully
    scored rows keep the order their rewards give: row 0 (1, 0.5) > row 2 (1, 0) > row 3 (0, 0). Row 1's
    place depends on the aggregation and is not asked. `s` is a Scorer, or a dict of several (TRL's two
    aggregations), each of which must hold."""
    if isinstance(s, dict):
        got = {name: one_nan_experiment(one) for name, one in s.items()}
        return all(h for h, _ in got.values()), "; ".join(f"{name}: {m}" for name, (_, m) in got.items())
    per_fn = np.array([[1.0, 0.5], [0.0, np.nan], [1.0, 0.0], [0.0, 0.0]])
    A = s.advantages(per_fn, np.array([1.0, 0.5]), 4)
    finite = bool(np.isfinite(A).all())
    if not finite:
        return False, f"non-finite advantages: {int((~np.isfinite(A)).sum())} of 4"
    ordered = bool(A[0] > A[2] > A[3])
    centred = abs(float(A.sum())) < 1e-6
    return finite and ordered and centred, (f"non-finite advantages: 0 of 4, sum A = {float(A.sum()):.2g}, "
                                            f"A0 > A2 > A3: {ordered} (A = {np.round(A, 4).tolist()})")


def default_zero_experiment(s: Scorer) -> tuple[bool, str]:
    # TRL #6427's four siblings: 0 and 3 submitted nothing (unscorable), 1 and 2 submitted a wrong answer
    rewards = s.contract(["explored", "submit 41", "submit 43", "explored"])
    A = s.advantages(rewards[:, None], np.ones(1), 4)
    # expected: the unscorable rows are NaN (stored as null) and get A = 0; the two scored rows are equal
    # (-1, -1): a zero-std group, A = 0 for all. With a 0.0 default: [0, -1, -1, 0] gives A = +-0.866
    ok = bool(np.isnan(rewards[[0, 3]]).all() and np.all(A == 0.0))
    return ok, f"stored rewards {rewards.tolist()}, A = {np.round(A, 4).tolist()}"


def cases() -> list[Case]:
    from pipeline.conformance import trl_adapter as trl

    return [
        Case("all-none-rewards", "a completion no reward function applies to gets advantage 0, not a 0.0 reward",
             "TRL #5775 (nansum of all-None rewards)", "A_i = 0 and the group's mean/std over the others: A = [0.9998, -0.9998, 0, 0]",
             all_none_experiment, grpo_scorer, nansum_scorer, trl=trl.scorer),
        Case("one-none-of-several", "one function's None never makes an advantage NaN",
             "ms-swift #8123 (GDPO NaN)", "every A finite; under the implementation's own aggregation sum A = 0 and A0 > A2 > A3 (the fully scored rows' order)",
             one_nan_experiment, grpo_scorer, gdpo_scorer, trl=trl.both_aggregations),
        Case("unscorable-not-zero", "an unscorable completion is None (NaN), not a default 0.0 reward",
             "TRL #6427 / #6430 (OpenReward default 0.0)", "rewards [None, -1, -1, None] -> stored [NaN, -1, -1, NaN], A = [0, 0, 0, 0]",
             default_zero_experiment, grpo_scorer, zero_default_scorer, trl=trl.scorer),
    ]
