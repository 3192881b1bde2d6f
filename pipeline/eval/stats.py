"""The estimators and intervals of an evaluation, as small pure functions.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): of n samples
of a prompt, c correct, the unbiased estimate of "at least one of k draws is correct" is
1 - C(n-c, k) / C(n, k); computed as the paper's stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i),
which never forms the binomials (C(1024, 512) overflows a float).

Intervals are 95 %: Wilson's score interval for a share of prompts (each prompt's figure 0 or 1),
a percentile bootstrap over prompts otherwise (seeded: the same record gives the same interval),
and a paired bootstrap for the difference of two records on the same prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Z95 = 1.959963984540054
"""The standard normal's 97.5 % quantile."""
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a binomial share successes/n."""
    if n == 0:
        return float("nan"), float("nan")
    if successes in (0, n):  # the closed form at p = 0 and p = 1: the bound the share sits on exact, not 1 - 1e-16
        return (0.0, z * z / (n + z * z)) if successes == 0 else (n / (n + z * z), 1.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: np.ndarray, seed: int = BOOTSTRAP_SEED, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """Percentile bootstrap of the mean of per-prompt values [m] (prompts resampled with replacement)."""
    m = len(values)
    if m < 2:  # one prompt has no spread to resample: [x, x] would claim certainty
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, m, size=(resamples, m))  # [B, m]
    means = values[idx].mean(axis=1)  # [B]
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def estimate(per_prompt: Sequence[float], rate: bool = True) -> tuple[float, float, float]:
    """(mean, lo, hi) of a figure from its per-prompt values (NaN: the prompt has none): Wilson
    when the figure is a `rate` and every value is 0 or 1 (a share of prompts), else the bootstrap
    over prompts (NaN bounds for a single prompt). A count that is 1 everywhere is no share."""
    v = np.asarray(per_prompt, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(v.mean())
    lo, hi = wilson(float(v.sum()), v.size) if rate and np.all((v == 0) | (v == 1)) else bootstrap(v)
    return (mean, lo, hi) if np.isnan(lo) else (mean, min(lo, mean), max(hi, mean))


def paired(a: Sequence[float], b: Sequence[float], seed: int = BOOTSTRAP_SEED,
           resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(mean of b - a, lo, hi): the paired bootstrap over prompts of two records' per-prompt values
    (the same prompts in the same order; a prompt NaN on either side is left out)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    d = d[~np.isnan(d)]
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = bootstrap(d, seed, resamples)
    return float(d.mean()), lo, hi


def majority(answers: Sequence[str | None], same: Callable[[str, str], bool],
             key: Callable[[str], object] | None = None) -> int | None:
    """The index of the first sample of the most common answer (answers equal as `same` says;
    a tie goes to the answer seen first; None, no answer, never votes), or None when none has one.

    `key` (optional) is a shortcut `same` must agree with: two answers with keys (not None) are the
    same answer exactly when their keys are equal, so they are never compared with `same`. Without
    it 1024 distinct answers take half a million math-verify calls (minutes per prompt)."""
    reps: list[int] = []  # a cluster's first sample
    counts: list[int] = []
    rep_keys: list[object] = []  # the key of a cluster's first sample (None: it has none)
    keyed: dict[object, int] = {}  # key -> its cluster
    for i, a in enumerate(answers):
        if a is None:
            continue
        kk = key(a) if key is not None else None
        if kk is not None and kk in keyed:
            counts[keyed[kk]] += 1
            continue
        for j, r in enumerate(reps):
            if kk is not None and rep_keys[j] is not None:
                continue  # two keyed answers, their keys differ: two answers
            if same(answers[r], a):
                counts[j] += 1
                break
        else:
            j = len(reps)
            reps.append(i)
            counts.append(1)
            rep_keys.append(kk)
        if kk is not None:
            keyed[kk] = j
    if not reps:
        return None
    return reps[int(np.argmax(counts))]  # argmax: the first of the largest clusters
