"""The eval's 95 % intervals against the truth, by seeded simulation (issue 64, item 7): every figure kind
`grpo eval` reports, at the sizes and shapes users have, with today's method (the one before issue 64) beside
the one pipeline/eval/intervals.py now runs, their coverage and their width.

    python -m bench.intervals [--records 1000] [--quick]   # writes bench/intervals.json
    python -m bench.intervals --regimes "judge 0-10"        # those mean regimes again, into it
    python -m bench.intervals_record                       # the scored-record cases, into it (bench/intervals_record.py)
    python -m bench.page                                   # redraws bench/results.md with it (make bench-intervals: all three)

A case: m prompts x G samples, each prompt with its own truth drawn from the case's population, each sample
drawn from its prompt; the figure's truth is the population's mean (exact, or from 4 million seeded draws
where no closed form is at hand). Per case, `--records` simulated evals (1000: a share's standard error at
0.95 is 0.0069, so 0.93 is 2.9 of them below; a quarter of that at 300 and 1000 prompts; `--compare`'s
cases 400, each record its own call) through the functions `grpo eval` runs (intervals.intervals, on
the spans pipeline/eval/metrics.py gives), and through today's method: Wilson's interval for a share of
prompts, else the wider of the effective-n Wilson and the generalised Wilson over prompts, a mean mapped by
its samples' own [min, max] ([x, x] when they are all one value). `--compare`'s interval and verdict on
paired records are simulated too (intervals.paired, sign_flip_p). The tests (tests/test_eval_intervals.py) run a
moderate slice of these cases; this runs them all (minutes on two cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import numpy as np

from pipeline.eval.intervals import effective_wilson, paired, sign_flip_p, tail_wilson, widened, wilson
from pipeline.eval.intervals import intervals as chosen_intervals
from pipeline.eval.metrics import MIN_PROMPTS, withheld
from pipeline.eval.stats import pass_at_k

PROMPTS = (3, 4, 5, 8, 10, 20, 30, 100, 300, 1000)
SAMPLES = (1, 4, 16)
BUDGET = 512  # rollout.max_new_tokens of the simulated evals: lengths are capped there
TRUTH_DRAWS = 4_000_000


# -- the populations ------------------------------------------------------------------------------------------

def _beta_mean_pow(a: float, b: float, k: int) -> float:
    """E[(1 - p)^k] for p ~ Beta(a, b)."""
    lg = math.lgamma
    return math.exp(lg(b + k) + lg(a + b) - lg(b) - lg(a + b + k))


RATES = {"p=0.001": 0.001, "p=0.01": 0.01, "p=0.05": 0.05, "p=0.2": 0.2, "p=0.5": 0.5, "p=0.8": 0.8,
         "p=0.95": 0.95, "p=0.99": 0.99, "p=0.999": 0.999,
         "Beta(0.2,2)": (0.2, 2.0), "Beta(2,0.2)": (2.0, 0.2), "Beta(0.5,0.5)": (0.5, 0.5), "Beta(0.05,5)": (0.05, 5.0)}
"""Each prompt's true rate: fixed, or drawn from a Beta (Beta(0.05, 5): mean 0.01, nearly all prompts at 0)."""


def prompt_rates(rng, regime, shape):
    r = RATES[regime]
    return np.full(shape, r) if isinstance(r, float) else rng.beta(r[0], r[1], shape)


def rate_truth(regime, k: int) -> float:
    """pass@k's truth (k = 1: the rate): 1 - E[(1 - p)^k], Chen et al.'s estimate being unbiased."""
    r = RATES[regime]
    return 1 - ((1 - r) ** k if isinstance(r, float) else _beta_mean_pow(*r, k))


def _mean_regimes():
    """{name: (draw(rng, shape [R, m], G) -> samples [R, m, G], declared span or None)} of the means."""
    def pm1(q_of):  # a -1/+1 reward, +1 with the prompt's chance q
        return lambda rng, shape, g: np.where(rng.random((*shape, g)) < q_of(rng, shape)[..., None], 1.0, -1.0)

    def judge(a, b):  # a 0-10 judge score: Binomial(10, q), q ~ Beta(a, b) a prompt
        return lambda rng, shape, g: rng.binomial(10, rng.beta(a, b, shape)[..., None], (*shape, g)).astype(np.float64)

    def unit(a, b, kappa=4.0):  # a reward in [0, 1] (code_tests' fraction): Beta around the prompt's mean
        def draw(rng, shape, g):
            mu = np.clip(rng.beta(a, b, shape)[..., None], 1e-3, 1 - 1e-3)
            return rng.beta(kappa * mu, kappa * (1 - mu), (*shape, g))
        return draw

    def rare(base, other, q):  # every sample at `base`, one in 1/q at `other`
        return lambda rng, shape, g: np.where(rng.random((*shape, g)) < q, other, base)

    def lengths_skewed(rng, shape, g):  # lognormal around a lognormal prompt mean, capped
        mu = 60 * np.exp(0.6 * rng.standard_normal(shape))[..., None]
        return np.clip(np.round(mu * np.exp(0.5 * rng.standard_normal((*shape, g)))), 1, BUDGET)

    def lengths_capped(a, b):  # at the cap with the prompt's chance q ~ Beta(a, b), else 50-511 tokens
        def draw(rng, shape, g):
            q = rng.beta(a, b, shape)[..., None]
            return np.where(rng.random((*shape, g)) < q, float(BUDGET), rng.integers(50, BUDGET, (*shape, g)).astype(np.float64))
        return draw

    def lengths_rare_cap(rng, shape, g):  # short answers, a prompt's chance q ~ Beta(0.1, 9.9) of running to the cap
        q = rng.beta(0.1, 9.9, shape)[..., None]
        short = np.clip(np.round(40 * np.exp(0.3 * rng.standard_normal((*shape, g)))), 1, BUDGET)
        return np.where(rng.random((*shape, g)) < q, float(BUDGET), short)

    fixed = lambda q: lambda rng, shape: np.full(shape, q)  # noqa: E731
    out = {}
    for declared, tag in (((-1.0, 1.0), "declared [-1,1]"), (None, "no range declared")):
        out[f"reward -1/+1, +1 at 0.01 ({tag})"] = (pm1(fixed(0.01)), declared)
        out[f"reward -1/+1, +1 at 0.99 ({tag})"] = (pm1(fixed(0.99)), declared)
        out[f"reward -1/+1, +1 at Beta(0.1,4.9) ({tag})"] = (pm1(lambda rng, shape: rng.beta(0.1, 4.9, shape)), declared)
        out[f"reward -1/+1, +1 at 0.5 ({tag})"] = (pm1(fixed(0.5)), declared)
    for declared, tag in (((0.0, 10.0), "declared [0,10]"), (None, "no range declared")):
        out[f"judge 0-10, Beta(5,2) ({tag})"] = (judge(5, 2), declared)
        out[f"judge 0-10, Beta(0.3,3) ({tag})"] = (judge(0.3, 3), declared)
    for declared, tag in (((0.0, 1.0), "declared [0,1]"), (None, "no range declared")):
        out[f"reward in [0,1], Beta(2,5) ({tag})"] = (unit(2, 5), declared)
        out[f"reward in [0,1], Beta(0.3,0.3) ({tag})"] = (unit(0.3, 0.3), declared)
        out[f"reward 0.5, one in 500 at 1.5 ({tag.replace('[0,1]', '[0,1.5]')})"] = (rare(0.5, 1.5, 0.002), (0.0, 1.5) if declared else None)
    out["reward all 1.0 (no range declared)"] = (rare(1.0, 1.0, 0.0), None)
    out["length lognormal, capped at 512"] = (lengths_skewed, (0.0, float(BUDGET)))
    out["length at the cap with Beta(9,1)"] = (lengths_capped(9, 1), (0.0, float(BUDGET)))
    out["length at the cap with Beta(50,0.5)"] = (lengths_capped(50, 0.5), (0.0, float(BUDGET)))
    out["length short, the cap with Beta(0.1,9.9)"] = (lengths_rare_cap, (0.0, float(BUDGET)))
    return out


MEANS = _mean_regimes()


@functools.lru_cache(maxsize=None)
def mean_truth(name: str, draws: int = TRUTH_DRAWS) -> float:
    """The population mean of a mean regime: 4 million seeded (prompt, sample) draws (standard error
    sd / 2000, far below the narrowest interval simulated; the tests' slice takes 500000 at 20 prompts and fewer)."""
    draw, _ = MEANS[name]
    rng = np.random.default_rng([64, list(MEANS).index(name)])
    return float(np.mean(draw(rng, (draws,), 1)))


# -- the two methods ------------------------------------------------------------------------------------------

def today(v: np.ndarray, rate: bool, samples: float, a: np.ndarray, b: np.ndarray):
    """The method before issue 64 (pipeline/eval/stats.py at c4d8cc2), vectorised: Wilson over prompts for a
    share, else the wider of the effective-n Wilson and the generalised Wilson on [a, b], the samples' own
    range for a mean; [x, x] when that range is one value."""
    a, b = np.minimum(a, v.min(-1)), np.maximum(b, v.max(-1))
    width = np.where(b > a, b - a, 1.0)
    x = (v - a[:, None]) / width[:, None]
    lo, hi = effective_wilson(x, samples)
    tlo, thi = tail_wilson(x)
    lo, hi = np.minimum(lo, tlo), np.maximum(hi, thi)
    if rate:
        share = np.all((v == 0) | (v == 1), axis=-1)
        if share.any():
            w = np.array([wilson(s, v.shape[-1]) for s in v[share].sum(-1)])
            lo[share], hi[share] = w[:, 0], w[:, 1]
    mean = v.mean(-1)
    lo, hi = np.minimum(a + width * lo, mean), np.maximum(a + width * hi, mean)
    same = b == a
    return np.where(same, mean, lo), np.where(same, mean, hi)


def chosen(v, rate, samples, a, b):
    return chosen_intervals(v, rate, samples, a, b)


def _measure(v, truth, rate, samples, span_today, span_new, withheld=None) -> dict:
    """Each method's coverage and width over the records it gives an interval, and the share it gives none
    (`withheld` [R]: where `grpo eval` gives the chosen method's figure none, metrics.withheld)."""
    out = {}
    for name, fn, span in (("today", today, span_today), ("chosen", chosen, span_new)):
        lo, hi = fn(v, rate, samples, *span)
        if name == "chosen" and withheld is not None:
            lo, hi = np.where(withheld, np.nan, lo), np.where(withheld, np.nan, hi)
        out[name] = measured(lo, hi, truth)
    if withheld is not None and withheld.any() and not withheld.all():  # today's width on the records given one now
        tlo, thi = today(v, rate, samples, *span_today)
        out["chosen"]["width_today"] = float(np.mean((thi - tlo)[~withheld]))
    return out


def measured(lo: np.ndarray, hi: np.ndarray, truth: float) -> dict:
    """coverage and width over the records with an interval (NaN: none has one), and the share without."""
    given = ~np.isnan(lo)
    held = (lo <= truth + 1e-9) & (truth - 1e-9 <= hi)
    with np.errstate(invalid="ignore"):
        return {"coverage": float(np.mean(held[given])) if given.any() else float("nan"),
                "width": float(np.mean((hi - lo)[given])) if given.any() else float("nan"),
                "zero_width": float(np.mean((hi - lo)[given] <= 0)) if given.any() else 0.0,
                "withheld": float(np.mean(~given))}


# -- the cases ------------------------------------------------------------------------------------------------

def records_at(records: int, m: int) -> int:
    """Records a case: `records`, a quarter of them at 300 prompts and more (where the intervals are nearly
    normal ones and each record is thousands of samples: on two shared cores the full run would take an hour)."""
    return records if m <= 100 else max(1, records // 4)


def rate_cases(records: int, prompts=PROMPTS, samples=SAMPLES, regimes=tuple(RATES)):
    """mean@G (the accuracy) and pass@k (k = 4, G: Chen et al.'s estimate from G samples) of every rate regime."""
    rows = []
    for regime in regimes:
        for g in samples:
            for m in prompts:
                rng = np.random.default_rng([64, 1, list(RATES).index(regime), g, m])
                R = records_at(records, m)
                p = prompt_rates(rng, regime, (R, m))
                c = (rng.random((R, m, g)) < p[..., None]).sum(-1)  # [R, m] correct samples a prompt
                ones = np.ones(R)
                for k in sorted({1, 4, g} & set(range(1, g + 1))):
                    table = np.array([pass_at_k(g, j, k) for j in range(g + 1)])
                    v = table[c]
                    res = _measure(v, rate_truth(regime, k), True, m * g / k, (0 * ones, ones), (0 * ones, ones))
                    rows.append({"family": "rate", "regime": regime, "figure": "accuracy" if k == 1 else f"pass@{k}",
                                 "prompts": m, "samples": g, "records": R, **res})
    return rows


def mean_cases(records: int, prompts=PROMPTS, samples=SAMPLES, regimes=tuple(MEANS), truth_draws: int = TRUTH_DRAWS):
    """Each mean regime's figure: the per-prompt mean of its samples, on the span metrics.py gives (declared,
    else the record's samples' range widened: intervals.widened) and, for today's, the samples' own range."""
    rows = []
    for regime in regimes:
        draw, declared = MEANS[regime]
        truth = mean_truth(regime, truth_draws)
        for g in samples:
            for m in prompts:
                rng = np.random.default_rng([64, 2, list(MEANS).index(regime), g, m])
                x = draw(rng, (records_at(records, m), m), g)  # [R, m, G]
                v = x.mean(-1)
                lo, hi = x.min(axis=(1, 2)), x.max(axis=(1, 2))
                known = declared_range(declared)
                new = (np.minimum(known[0], lo), np.maximum(known[1], hi)) if known else widened(lo, hi)
                res = _measure(v, truth, False, m * g, (lo, hi), new, None if known else withheld(m, lo, hi, False))
                rows.append({"family": "length" if regime.startswith("length") else "reward", "regime": regime,
                             "figure": "mean", "prompts": m, "samples": g, "records": len(v), **res})
    return rows


def declared_range(declared: tuple[float, float] | None) -> tuple[float, float] | None:
    """The span `grpo eval` takes for your own reward function declaring `declared` (`range:` on its entry: the
    config and pipeline/eval/metrics.py's `declared`, as a run reads them), None where it declares none."""
    from pipeline.config.rewards import validate_reward
    from pipeline.eval.metrics import declared as declared_of

    spec = validate_reward({"fn": "my_rewards.py:score", **({"range": list(declared)} if declared else {})})
    return declared_of(spec)


COMPARE = {"rates U(0.2,0.8), no difference": ("U(0.2,0.8)", 0.0), "shift +0.1": ("U(0.2,0.8)", 0.1),
           "shift +0.25": ("U(0.2,0.8)", 0.25), "near-ties at 0.02/0.93, shift +0.05": ("ends", 0.05),
           "near-ties at 0.02/0.93, no difference": ("ends", 0.0)}
"""`--compare`'s cases: A's prompt rates r (uniform in [0.2, 0.8], or 0.02 or 0.93 each: most prompts tie), B's
r + shift (at most 1); the truth is the mean of min(r + shift, 1) - r. Each side samples its G samples anew."""


def compare_truth(pop: str, shift: float) -> float:
    """E[min(r + shift, 1) - r]: the shift, less what the cap at 1 takes (r uniform in [0.2, 0.8]: the part above
    1 - shift, (0.8 + shift - 1)^2 / 2 / 0.6; the 0.02/0.93 population is never capped at these shifts)."""
    return shift - (max(0.0, 0.8 + shift - 1) ** 2 / 2 / 0.6 if pop == "U(0.2,0.8)" else 0.0)


def compare_cases(records: int, prompts=(3, 6, 8, 10, 30, 100), samples=(1, 4, 16)):
    rows = []
    for name, (pop, shift) in COMPARE.items():
        for g in samples:
            for m in prompts:
                rng = np.random.default_rng([64, 3, list(COMPARE).index(name), g, m])
                r = rng.uniform(0.2, 0.8, (records, m)) if pop == "U(0.2,0.8)" else np.where(rng.random((records, m)) < 0.5, 0.02, 0.93)
                a = (rng.random((records, m, g)) < r[..., None]).mean(-1)
                b = (rng.random((records, m, g)) < (r + shift)[..., None]).mean(-1)
                p = np.array([sign_flip_p(b[i] - a[i])[0] for i in range(records)])  # each record's own, as compare's
                truth = compare_truth(pop, shift)
                held = agree = zero = 0
                widths = []
                for i in range(records):
                    _, lo, hi = paired(a[i], b[i], span=(0.0, 1.0), samples=2 * m * g)
                    if lo != lo:
                        continue
                    held += lo <= truth + 1e-9 and truth - 1e-9 <= hi
                    agree += (p[i] <= 0.05) == (not lo <= 0 <= hi)
                    zero += hi - lo <= 0
                    widths.append(hi - lo)
                rows.append({"family": "compare", "regime": name, "prompts": m, "samples": g, "truth": truth,
                             "coverage": held / records, "agree": agree / records, "zero_width": zero / records,
                             "width": float(np.mean(widths)) if widths else float("nan"),
                             "distinguishable": float(np.mean(p <= 0.05))})
    return rows


def run(records: int, quick: bool = False) -> dict:
    started = time.time()
    prompts = (3, 5, 10, 100) if quick else PROMPTS
    rows = rate_cases(records, prompts) + mean_cases(records, prompts)
    cmp = compare_cases(min(records, 400), (3, 8, 30) if quick else (3, 6, 8, 10, 30, 100))
    return {"records": records, "seconds": round(time.time() - started, 1), "cases": rows, "compare": cmp}


# -- the page -------------------------------------------------------------------------------------------------

OUT_NAME = "intervals.json"


def section(res: dict) -> list[str]:
    """bench/results.md's section: per family and number of prompts, the cases that hold 0.93 and the lowest
    coverage, today's and now, and the median width now over today's; the worst cases; --compare."""
    rows = res["cases"]
    out = ["## Eval intervals (bench/intervals.py)", "",
           f"`python -m bench.intervals --records {res['records']}` ({res['seconds']:.0f} s): {len(rows)} cases (m prompts x G = 1, 4, 16 "
           "samples; rates 0.001-0.999 fixed or Beta-spread, accuracy and pass@k; -1/+1, 0-10, [0, 1] and all-equal rewards with "
           "and without a declared range; lognormal, mostly capped and rarely capped lengths, max_new_tokens 512), "
           f"{res['records']} seeded records each ({res['records'] // 4} at 300 and 1000 prompts; --compare 400). Coverage of the 95 % interval (a share's standard error at 0.95: "
           f"{math.sqrt(0.95 * 0.05 / res['records']):.4f}); width: the mean of hi - lo, now over today's (median over the cases).", "",
           "| family | prompts | cases | >= 0.93 today | >= 0.93 now | lowest today | lowest now | zero-width records today | now | no interval now (records, most of a case) | width now / today (median, max) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    fams = sorted({r["family"] for r in rows})
    total_t = total_n = total_given = 0
    for fam in fams:
        for m in sorted({r["prompts"] for r in rows}):
            sel = [r for r in rows if r["family"] == fam and r["prompts"] == m]
            if not sel:
                continue
            t = [r["today"]["coverage"] for r in sel]
            n = [r["chosen"]["coverage"] for r in sel if r["chosen"]["coverage"] == r["chosen"]["coverage"]]
            ratio = [r["chosen"]["width"] / r["chosen"].get("width_today", r["today"]["width"]) for r in sel
                     if r["chosen"].get("width_today", r["today"]["width"]) > 0 and r["chosen"]["width"] == r["chosen"]["width"]]
            none = max(r["chosen"].get("withheld", 0.0) for r in sel)
            zt = max(r["today"]["zero_width"] for r in sel)
            zn = max(r["chosen"]["zero_width"] for r in sel)
            total_t += sum(c >= 0.93 for c in t)
            total_n += sum(c >= 0.93 for c in n)
            total_given += len(n)
            out.append(f"| {fam} | {m} | {len(sel)} | {sum(c >= 0.93 for c in t)} | {sum(c >= 0.93 for c in n)} | {min(t):.3f} | "
                       f"{min(n):.3f} | {zt:.3f} | {zn:.3f} | {none:.2f} | "
                       + (f"{np.median(ratio):.2f}, {max(ratio):.2f}" if ratio else "-") + " |")
    empty = [r for r in rows if r["chosen"].get("withheld", 0.0) == 1.0]
    out += ["", f"In all: {total_t} of {len(rows)} cases hold 0.93 today; now {total_n} of the {total_given} cases that give "
            f"intervals" + (f", and {len(empty)} give none" if empty else "") + "."]
    held = [r for r in rows if r["chosen"].get("withheld", 0.0) > 0]
    if held:
        out += ["", f"No interval now (NaN bounds, the page saying why): some or all records of {len(held)} cases, a reward "
                f"that declares no range in a run that scored nothing yet, below {MIN_PROMPTS} prompts or all its samples "
                "alike (metrics.withheld; a run's scored samples give it one: bench/intervals_record.py below); coverage and "
                "width now are over the records given one, their width ratio against today's on the same records."]
    missed = [r for r in rows if r["chosen"]["coverage"] < 0.93]
    undeclared = [r for r in missed if r["regime"].endswith("(no range declared)")]
    twins = [t for r in undeclared for t in rows if t["regime"] != r["regime"] and "(declared [" in t["regime"]
             and t["regime"].split(" (")[0] == r["regime"].split(" (")[0] and (t["prompts"], t["samples"]) == (r["prompts"], r["samples"])]
    if undeclared and len(twins) == len(undeclared):
        cov = [t["chosen"]["coverage"] for t in twins]
        out += ["", f"Of the {len(missed)} below 0.93 now, {len(undeclared)} are a custom reward that declares no range; the same "
                f"draws with the range declared (`rewards: [{{fn: ..., range: [lo, hi]}}]`, through the config and "
                f"metrics.declared) hold {min(cov):.3f}-{max(cov):.3f}."]
    if res.get("seconds_regimes"):
        out += ["", "Run again since with `--regimes` (each mean regime whose name holds the text; seconds): "
                + ", ".join(f"{k!r} {v:.0f} s" for k, v in res["seconds_regimes"].items()) + "."]
    out += [""]
    worst = sorted(rows, key=lambda r: r["chosen"]["coverage"] if r["chosen"]["coverage"] == r["chosen"]["coverage"] else 2)[:8]
    out += ["Lowest coverage now:", "", "| case | m x G | today | now | width today | width now |", "|---|---|---|---|---|---|"]
    for r in worst:
        out.append(f"| {r['regime']} {r['figure']} | {r['prompts']} x {r['samples']} | {r['today']['coverage']:.3f} | "
                   f"{r['chosen']['coverage']:.3f} | {r['today']['width']:.4g} | {r['chosen']['width']:.4g} |")
    widest = sorted((r for r in rows if r["today"]["width"] > 0 and r["chosen"]["width"] == r["chosen"]["width"]),
                    key=lambda r: -r["chosen"]["width"] / r["today"]["width"])[:8]
    out += ["", "Largest width cost:", "", "| case | m x G | today | now | width today | width now |", "|---|---|---|---|---|---|"]
    for r in widest:
        out.append(f"| {r['regime']} {r['figure']} | {r['prompts']} x {r['samples']} | {r['today']['coverage']:.3f} | "
                   f"{r['chosen']['coverage']:.3f} | {r['today']['width']:.4g} | {r['chosen']['width']:.4g} |")
    cmp = res["compare"]
    out += ["", "`--compare` (intervals.paired on two records of the same prompts, span [0, 1]; the verdict is the sign-flip "
            "test at 5 %): coverage of the true shift, agreement of interval and verdict, zero-width intervals, the share "
            "called distinguishable, the mean width.", "",
            "| case | G | " + " | ".join(f"m={m}" for m in sorted({r['prompts'] for r in cmp})) + " |",
            "|---|---|" + "---|" * len({r['prompts'] for r in cmp})]
    for name in COMPARE:
        for g in sorted({r["samples"] for r in cmp}):
            sel = sorted((r for r in cmp if r["regime"] == name and r["samples"] == g), key=lambda r: r["prompts"])
            out.append(f"| {name} | {g} | " + " | ".join(
                f"{r['coverage']:.3f} / {r['agree']:.3f} / {r['zero_width']:.3f} / {r['distinguishable']:.3f} / {r['width']:.2f}"
                for r in sel) + " |")
    out += ["", "Each cell: coverage / agreement / zero-width share / distinguishable share / mean width.", ""]
    return out


def main() -> None:
    from bench.workloads import ROOT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (for developing the bench)")
    ap.add_argument("--compare-only", action="store_true", help="run --compare's cases again into the existing JSON")
    ap.add_argument("--regimes", metavar="TEXT", help="run the mean regimes whose name holds TEXT again into the existing JSON")
    args = ap.parse_args()
    if args.regimes:
        res = json.loads((ROOT / OUT_NAME).read_text())
        names = [n for n in MEANS if args.regimes in n]
        if not names:
            raise SystemExit(f"--regimes {args.regimes!r}: no mean regime's name holds it")
        started = time.time()
        new = mean_cases(res["records"], regimes=tuple(names))
        again = {(r["regime"], r["prompts"], r["samples"]): r for r in new}
        res["cases"] = [again.pop((r["regime"], r["prompts"], r["samples"]), r) if r["family"] != "rate" else r
                        for r in res["cases"]] + list(again.values())  # in place, in the order they were
        res.setdefault("seconds_regimes", {})[args.regimes] = round(time.time() - started, 1)
    elif args.compare_only:
        res = json.loads((ROOT / OUT_NAME).read_text())
        started = time.time()
        res["compare"] = compare_cases(min(res["records"], 400))
        res["seconds_compare"] = round(time.time() - started, 1)
    else:
        res = run(args.records, args.quick)
    (ROOT / OUT_NAME).write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(section(res)))


if __name__ == "__main__":
    main()
