"""The 95 % intervals of an evaluation's figures and of a paired comparison, as small pure functions.

Intervals are on the range a figure can take mapped onto [0, 1] (a rate: [0, 1]; a mean: its declared
range, else the range the run's scored samples and its own took (`recorded`), else its samples' range widened:
pipeline/eval/metrics.py's span, `widened`): Clopper-Pearson's exact
interval for a share of prompts (each prompt's figure 0 or 1), otherwise the wider at each end of
Clopper-Pearson on an effective sample size (effective_cp: both levels of sampling) and Wilson's over
prompts generalised to values in [0, 1] (tail_wilson: a tail the few prompts did not show). For the
difference of two records on the same prompts the exact sign-flip test (sign_flip_p) decides
"distinguishable", and the interval (paired) is the mean difference's, widened to hold 0 where the test
does not reject, so the interval and the verdict never disagree. SciPy gives the Beta and t quantiles.
docs/tracking.md has the simulation that chose them (bench/intervals.py) and their measured coverage.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054
"""The standard normal's 97.5 % quantile."""
FLIP_SEED = 0
"""The seed of the sign-flip test's drawn flips (above SIGN_FLIP_EXACT differing prompts)."""


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


def t975(df: int | np.ndarray) -> float | np.ndarray:
    """Student's t 97.5 % quantile with `df` degrees of freedom (SciPy's)."""
    from scipy import stats

    return stats.t.ppf(0.975, df)


def clopper_pearson(successes: float | np.ndarray, n: float | np.ndarray,
                    alpha: float | np.ndarray = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Clopper and Pearson's exact interval for a binomial share successes/n: the shares whose binomial
    tail at the count seen is alpha/2 or more, as quantiles of Beta distributions (SciPy's), so it covers at
    least 1 - alpha at every true share and every n (Wilson's score interval dips to 0.87 at n = 3-5, and its
    lower end at 1 success of 100 is 0.0018, above a true 0.001). Vectorised; `successes` and `n` need not be
    whole (effective_cp), 0 and n give the closed ends 0 and 1."""
    from scipy import stats

    s, n = np.broadcast_arrays(np.asarray(successes, dtype=np.float64), np.asarray(n, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.where(s > 0, stats.beta.ppf(alpha / 2, np.maximum(s, 1e-300), n - s + 1), 0.0)
        hi = np.where(s < n, stats.beta.ppf(1 - alpha / 2, s + 1, np.maximum(n - s, 1e-300)), 1.0)
    return (float(lo), float(hi)) if lo.ndim == 0 else (lo, hi)


def effective_cp(x: np.ndarray, samples: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Clopper-Pearson on an effective sample size, for the mean of per-prompt values in [0, 1].

    x [..., m]: each prompt's value (a share of its samples, an unbiased pass@k, a mean mapped onto [0, 1]
    by its span); `samples`: the independent draws behind them (an upper bound on the information). The
    variance of the mean is taken from the prompts, s^2 / m, which holds both levels of sampling (between
    prompts and within one); the design effect turns it into the sample size a binomial share of that
    variance would have, n_eff = p(1 - p) / (s^2 / m), capped at the samples drawn (s^2 = 0, ten prompts
    each 4 of 8, is then 40 of 80, never a zero width), and the interval is Clopper-Pearson's for p n_eff
    of n_eff. Clopper-Pearson, not Wilson's score interval: one success in 128 samples has Wilson's lower
    end 0.0011 (t of 7 degrees of freedom), above a true rate of 0.001. Its exact tails make Student's t
    quantile the Wilson form needed unnecessary (bench/intervals.py measured both: t's at 3 prompts spans
    the whole range). Vectorised over leading axes."""
    m = x.shape[-1]
    p = x.mean(axis=-1)
    var = x.var(axis=-1, ddof=1) / m
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.minimum(np.where(var > 0, p * (1 - p) / var, np.inf), samples)
    n = np.maximum(n, 1.0)  # values in [0, 1] have s^2 <= p (1 - p) m / (m - 1), so n_eff >= m - 1 already
    lo, hi = clopper_pearson(p * n, n)
    return np.minimum(lo, p), np.maximum(hi, p)


def effective_wilson(x: np.ndarray, samples: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Wilson's score interval on an effective sample size (the interval before effective_cp, kept for the
    bench's comparison with today's method: bench/intervals.py)."""
    m = x.shape[-1]
    p = x.mean(axis=-1)
    var = x.var(axis=-1, ddof=1) / m
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.minimum(np.where(var > 0, p * (1 - p) / var, np.inf), samples)
    z = t975(m - 1)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(np.maximum(p * (1 - p), 0) / n + z * z / (4 * n * n)) / denom
    return np.clip(np.minimum(centre - half, p), 0, 1), np.clip(np.maximum(centre + half, p), 0, 1)


def tail_wilson(x: np.ndarray, z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson's score interval over the m prompts, generalised from 0/1 values to values in [0, 1].

    x [..., m]. The variance at a hypothesised mean p0 is that of the observed prompts mixed with the far
    end of the range (0 below the mean, 1 above) in the share that moves their mean to p0: the least
    favourable way for a tail the prompts did not show. Below the mean, with d = mean - p0 and s^2 the
    prompts' variance (ddof 0): d^2 = (z^2 / m) (s^2 p0 / mean + d p0), a quadratic in d; above, the
    same with 1 - x. For 0/1 values s^2 = mean (1 - mean) and this is Wilson's interval exactly; with a
    spread it is what covers where the prompts' rates pile at one end with a thin tail to the other
    (docs/tracking.md)."""
    m = x.shape[-1]
    c = z * z / m

    def below(p: np.ndarray, s2: np.ndarray) -> np.ndarray:  # d >= 0 solving (1 + c) d^2 - c (p - s2/p) d - c s2 = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            b = c * (p - np.where(p > 0, s2 / p, 0.0))
            d = (b + np.sqrt(b * b + 4 * (1 + c) * c * s2)) / (2 * (1 + c))
        return np.minimum(np.where(p > 0, d, 0.0), p)

    p, s2 = x.mean(axis=-1), x.var(axis=-1)
    return p - below(p, s2), p + below(1 - p, s2)


def widened(lo: float, hi: float) -> tuple[float, float]:
    """The span of a mean nobody declared a range for, from the smallest and largest value its samples took:
    that range widened on each side by the larger of its width and its ends' distance from 0 (all at -1:
    [-2, 0]; in [-1, 1]: [-3, 3]; all at 0, no scale at all: [-0.5, 0.5]). Samples all at one value say
    nothing of how far the others lie, and an interval on the samples' own range would be that value, zero
    wide, while a rare other value moves the truth (20 prompts x 4 samples all at -1 of a -1/+1 reward); half
    that widening left more of bench/intervals.py's cases below 0.93 (a 0-10 score mostly at 0-2 with a rare
    10, at 3-10 prompts). Vectorised (the bench passes arrays)."""
    w = np.maximum(np.maximum(np.subtract(hi, lo), np.abs(lo)), np.abs(hi))
    w = np.where(w > 0, w, 0.5)
    return lo - w, hi + w


RECORD_WIDENING = 0.25
"""How far past the range a reward took over the run's scored samples and the eval's (`recorded`) its span
reaches, in that range's width, on each side."""


def recorded(lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """The span of a mean nobody declared a range for whose run scored it: the range it took over the run's
    scored samples and the eval's, widened by a quarter of its width on each side (-1 and +1 seen: [-1.5, 1.5]).
    Hundreds of scored samples see a reward's support where three eval samples cannot, so the eval-only
    widening (`widened`: [-3, 3] there) is no longer needed: bench/intervals_record.py measured the record's
    range unwidened at 0.964 and up, a quarter at 0.997 and up, the eval-only widening (1.000) at about twice the
    width, with a 256-sample record missing a value at 1 % in 7.6 % of its runs. Vectorised."""
    w = RECORD_WIDENING * np.subtract(hi, lo)
    return np.subtract(lo, w), np.add(hi, w)


def bounds(x: np.ndarray, samples: np.ndarray | float, share: np.ndarray | bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The 95 % interval of the mean of per-prompt values x [..., m] in [0, 1] (vectorised over leading axes).

    A `share` (the figure is a rate and every value is 0 or 1: a share of prompts) gets Clopper-Pearson's
    interval over the prompts; any other record, at each end, the wider of effective_cp on `samples` (the
    independent draws behind the values) and the generalised Wilson over prompts (tail_wilson). m >= 2."""
    m = x.shape[-1]
    if m >= 2:
        lo, hi = effective_cp(x, samples)
        tlo, thi = tail_wilson(x)
        lo, hi = np.minimum(lo, tlo), np.maximum(hi, thi)
    else:  # one prompt: no spread to estimate (a share still has Clopper-Pearson's interval below)
        lo = hi = np.full(x.shape[:-1], np.nan)
    share = np.asarray(share) & np.all((x == 0) | (x == 1), axis=-1)
    if np.any(share):
        clo, chi = clopper_pearson(x.sum(axis=-1), m)
        lo, hi = np.where(share, clo, lo), np.where(share, chi, hi)
    p = x.mean(axis=-1)
    return np.clip(np.minimum(lo, p), 0, 1), np.clip(np.maximum(hi, p), 0, 1)


def estimate(per_prompt: Sequence[float], rate: bool = True, samples: float | None = None,
             span: tuple[float, float] | None = None) -> tuple[float, float, float]:
    """(mean, lo, hi) of a figure from its per-prompt values (NaN: the prompt has none).

    The values are mapped onto [0, 1] by `span`, the range the figure can take (a rate: [0, 1]; a mean: the
    range pipeline/eval/metrics.py's `span` gives it, declared or widened; None: the values' own range
    widened), get `bounds`'s interval there on `samples` (the independent draws behind them: the samples,
    over k for a k-sample figure; None: one a prompt) and are mapped back (`intervals`). A `rate` whose every
    value is 0 or 1 is a share of prompts: Clopper-Pearson's interval, one prompt included. One prompt of any
    other values has no spread to estimate: NaN bounds. A count that is 1 everywhere is no share."""
    v = np.asarray(per_prompt, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    if rate:
        a, b = 0.0, 1.0
    else:
        a, b = span if span is not None else widened(float(v.min()), float(v.max()))
    lo, hi = intervals(v[None], rate, samples if samples is not None else v.size, np.array([a]), np.array([b]))
    return float(v.mean()), float(lo[0]), float(hi[0])


def intervals(v: np.ndarray, rate: bool, samples: np.ndarray | float, a: np.ndarray,
              b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`estimate`'s (lo, hi) for records v [R, m] of per-prompt values (no NaN) whose figure can take [a, b]
    [R] (widened to the values if they pass it): vectorised, so that bench/intervals.py's simulation runs
    thousands of records through the code `grpo eval` runs."""
    a = np.minimum(np.asarray(a, dtype=np.float64), v.min(axis=-1))  # [R]
    b = np.maximum(np.asarray(b, dtype=np.float64), v.max(axis=-1))
    share = bool(rate) & np.all((v == 0) | (v == 1), axis=-1)
    width = np.where(b > a, b - a, 1.0)
    lo, hi = bounds((v - a[:, None]) / width[:, None], samples, share)
    mean = v.mean(axis=-1)
    lo, hi = np.minimum(a + width * lo, mean), np.maximum(a + width * hi, mean)
    none = (b == a) | ((v.shape[-1] < 2) & ~share)
    return np.where(none, np.nan, lo), np.where(none, np.nan, hi)


def paired(a: Sequence[float], b: Sequence[float], span: tuple[float, float] | None = None,
           samples: float | None = None, seed: int = FLIP_SEED, level: float = 0.05) -> tuple[float, float, float]:
    """(mean of b - a, lo, hi) over prompts of two records' per-prompt values (the same prompts in the
    same order; a prompt NaN on either side is left out), a 95 % interval that agrees with the verdict: 0 lies
    outside it exactly when the paired sign-flip test (sign_flip_p, which decides "distinguishable") rejects
    at `level`.

    The interval is `estimate`'s for the mean of the differences, mapped by the range a difference can take
    ([-(hi - lo), hi - lo] of the figure's `span`, the range its per-prompt values can take; None: their own
    range widened) on `samples` (the draws behind the differences: both sides' samples over all prompts, as a
    difference takes a sample of each; None: one a prompt). It needs no symmetry: inverting the sign-flip test,
    as before, assumed differences symmetric about the true shift, which -1/0/+1 differences are not (it
    covered 0.838 at 8 prompts x 1 sample), and made every record of ties [0, 0]. Where the test does not
    reject, the interval is widened to hold 0; where it rejects and the interval still holds 0, its end on 0's
    side moves to just past 0 (a billionth of the range: "+0.000" on the page, beside the verdict
    "distinguishable"), the least it must move to agree (the inverted test's end there, min(d) at 6 prompts,
    left out a true +0.25 in 10 % of records at 6 prompts x 4 samples). One prompt: NaN ends."""
    d = _differences(a, b)
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(d.mean())
    if d.size < 2:
        return mean, float("nan"), float("nan")
    if span is None:
        both = np.concatenate([np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)])
        span = widened(float(np.nanmin(both)), float(np.nanmax(both)))
    w = float(span[1] - span[0])
    w = max(w, float(np.abs(d).max())) or 1.0
    _, lo, hi = estimate(d, rate=False, samples=samples, span=(-w, w))
    if float(sign_flip_p(d, seed)[0]) > level:
        return mean, min(lo, 0.0), max(hi, 0.0)
    past = 1e-9 * w  # rejected (so the mean is not 0): the end on 0's side, if 0 is inside, just past it
    return (mean, max(lo, past), hi) if mean > 0 else (mean, lo, min(hi, -past))


def _differences(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    return d[~np.isnan(d)]


SIGN_FLIP_EXACT = 16
"""Up to this many differing prompts the sign-flip test enumerates all 2^n flips; above, FLIPS seeded draws."""
FLIPS = 20000


def sign_flip_p(d: np.ndarray, seed: int = FLIP_SEED) -> np.ndarray:
    """The two-sided p-value of the paired permutation (sign-flip) test of mean(d) = 0 over prompts.

    Under "A and B are the same policy" each prompt's difference is as likely negative as positive, so
    every flip of the signs is an equally likely record: p = the share of flips whose |sum| reaches the
    observed one. Prompts that tie (d = 0) flip to themselves and drop out; with n differing prompts the
    2^n flips are enumerated up to SIGN_FLIP_EXACT (an exact test: "4 of 30 won, none lost" is
    2 / 16 = 0.125, the sign test's p), else FLIPS seeded draws with (1 + hits) / (1 + draws), which
    keeps the test's size at or below its level. d [..., m] (vectorised over records, ties as 0)."""
    d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    obs = np.abs(d.sum(axis=-1))  # [R]
    n = int(np.max(np.sum(d != 0, axis=-1), initial=0))
    # ties sorted last: the flips of the first n columns are every flip that matters
    order = np.argsort(d == 0, axis=-1, kind="stable")
    dd = np.take_along_axis(d, order, axis=-1)[:, :n]  # [R, n]
    signs = _flips(n, seed)
    draws, extra = signs.shape[0], int(n > SIGN_FLIP_EXACT)
    hits = np.zeros(d.shape[0], dtype=np.int64)
    for i in range(0, draws, 4096):  # [R, 4096] sums at a time: 1000 prompts x 20000 flips would be 160 MB
        sums = np.abs(dd @ signs[i:i + 4096].T)  # [R, chunk]
        hits += np.sum(sums >= obs[:, None] - 1e-9 * (1 + obs[:, None]), axis=-1)  # float sums of equal flips
    return (hits + extra) / (draws + extra)


@functools.lru_cache(maxsize=8)
def _flips(n: int, seed: int) -> np.ndarray:
    """The sign flips of n differing prompts [draws, n] (float): all 2^n up to SIGN_FLIP_EXACT, else FLIPS
    seeded draws (the same draws for every test of n prompts, so `paired`'s bisection sees one p-value)."""
    if n <= SIGN_FLIP_EXACT:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    else:
        signs = 1 - 2 * np.random.default_rng(seed).integers(0, 2, size=(FLIPS, n))
    signs = signs.astype(np.float64)
    signs.setflags(write=False)
    return signs
