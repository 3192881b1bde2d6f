"""The undeclared reward's interval with and without the run's scored record (issue 64, item 7's last gap), by
seeded simulation: bench/intervals.py's rewards that declare no range, and two with a rare far value, at 3-8
prompts x 1 and 4 samples.

    python -m bench.intervals_record [--records 1000]   # into bench/intervals.json's `record` (after bench.intervals)

Per record (one simulated eval) the run's own record is drawn too: RECORD_PROMPTS x RECORD_SAMPLES samples from
the same reward's population (the score stage's samples of a small run: 256), whose least and largest value is
what pipeline/eval/observed.py reads from the score parts. The spans, through the code `grpo eval` runs
(metrics.withheld, intervals.widened and recorded, intervals.intervals):

    eval only           the eval's samples' range widened (intervals.widened), every record an interval (before)
    no record           the same, no interval where metrics.withheld says (below MIN_PROMPTS prompts, or all alike)
    record              the eval's samples joined with the record's range, a quarter of its width past each end
                        (intervals.recorded, what `grpo eval` takes); none where all of them are alike
    record unwidened    that range as it is; record widened x1: widened as the eval-only range is
    declared            the range a `range:` on the reward's entry would give (the width a declared range costs)

A rare value at 1 % or 4 % (a [0, 1] reward with one sample in 100 or 25 at 10) is missed by the 256-sample
record in 7.6 % or 0 % of records, and by a 3-prompt eval nearly always: the record's span is then [0, 1]
widened to [-1, 2], and the interval has to hold the truth the rare value moves (0.1 or 0.4 above the base).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np

from bench.intervals import MEANS, OUT_NAME, mean_truth, measured
from pipeline.eval.intervals import intervals, recorded, widened
from pipeline.eval.metrics import withheld

RECORD_PROMPTS, RECORD_SAMPLES = 64, 4  # the record: 256 scored samples
PROMPTS = (3, 4, 5, 6, 7, 8)
SAMPLES = (1, 4)


def _rare_zero(q: float):
    """A reward at 0, one sample in 1/q at 10: an eval of a few prompts all at 0 says nothing of the 10."""
    return lambda rng, shape, g: np.where(rng.random((*shape, g)) < q, 10.0, 0.0)


def _rare_unit(q: float):
    """A reward in [0, 1] (Beta around a prompt's Beta(2, 5) mean), one sample in 1/q at 10."""
    def draw(rng, shape, g):
        mu = np.clip(rng.beta(2, 5, shape)[..., None], 1e-3, 1 - 1e-3)
        base = rng.beta(4 * mu, 4 * (1 - mu), (*shape, g))
        return np.where(rng.random((*shape, g)) < q, 10.0, base)
    return draw


EXTRA = {"reward in [0,1], one in 100 at 10 (no range declared)": (_rare_unit(0.01), (0.0, 10.0)),
         "reward in [0,1], one in 25 at 10 (no range declared)": (_rare_unit(0.04), (0.0, 10.0)),
         "reward 0, one in 20 at 10 (no range declared)": (_rare_zero(0.05), (0.0, 10.0))}
"""The regimes beyond bench/intervals.py's: {name: (draw, the range a declared twin would give)}."""


def regimes() -> dict:
    """{name: (draw, declared twin's range or None)}: bench/intervals.py's undeclared rewards, then EXTRA's."""
    out = {}
    for name, (draw, _) in MEANS.items():
        if name.endswith("(no range declared)") and not name.startswith("length"):
            twin = next((d for n, (_, d) in MEANS.items() if d and n.split(" (")[0] == name.split(" (")[0]), None)
            out[name] = (draw, twin)
    return out | EXTRA


@functools.lru_cache(maxsize=None)
def truth(name: str, draws: int) -> float:
    """The population mean: `draws` seeded (prompt, sample) draws (bench/intervals.py's mean_truth, for EXTRA too)."""
    if name in MEANS:
        return mean_truth(name, draws)
    rng = np.random.default_rng([64, 9, list(EXTRA).index(name)])
    return float(np.mean(EXTRA[name][0](rng, (draws,), 1)))


def record_cases(records: int, prompts=PROMPTS, samples=SAMPLES, names=None, truth_draws: int = 4_000_000) -> list[dict]:
    rows = []
    table = regimes()
    for name in names or table:
        draw, declared = table[name]
        t = truth(name, truth_draws)
        for g in samples:
            for m in prompts:
                rng = np.random.default_rng([64, 8, list(table).index(name), g, m])
                x = draw(rng, (records, m), g)  # [R, m, G]: the eval
                rec = draw(rng, (records, RECORD_PROMPTS), RECORD_SAMPLES)  # [R, 64, 4]: the run's scored samples
                v = x.mean(-1)
                lo, hi = x.min(axis=(1, 2)), x.max(axis=(1, 2))
                rlo, rhi = np.minimum(lo, rec.min(axis=(1, 2))), np.maximum(hi, rec.max(axis=(1, 2)))
                res = {}
                alike = withheld(m, rlo, rhi, True)
                for method, (a, b), none in (("eval only", widened(lo, hi), np.zeros(records, bool)),
                                             ("no record", widened(lo, hi), withheld(m, lo, hi, False)),
                                             ("record", recorded(rlo, rhi), alike),
                                             ("record unwidened", (rlo, rhi), alike),
                                             ("record widened x1", widened(rlo, rhi), alike)):
                    ilo, ihi = intervals(v, False, m * g, a, b)
                    res[method] = measured(np.where(none, np.nan, ilo), np.where(none, np.nan, ihi), t)
                if declared is not None:
                    ilo, ihi = intervals(v, False, m * g, np.full(records, declared[0]), np.full(records, declared[1]))
                    res["declared"] = measured(ilo, ihi, t)
                top, bottom = support(name)
                res["record_missed"] = float(np.mean(rec.max(axis=(1, 2)) < top - 0.05 * (top - bottom)))
                rows.append({"regime": name, "prompts": m, "samples": g, "records": records, "truth": t, **res})
    return rows


@functools.lru_cache(maxsize=None)
def support(name: str) -> tuple[float, float]:
    """The largest and least value of 1 million seeded draws: the top the record may fall short of."""
    rng = np.random.default_rng([64, 7, list(regimes()).index(name)])
    x = regimes()[name][0](rng, (1_000_000,), 1)
    return float(x.max()), float(x.min())


def section(rows: list[dict], seconds: float) -> list[str]:
    """bench/results.md's part on them: coverage (withheld share) and width per case, the worst first."""
    if not rows:
        return []
    R = rows[0]["records"]
    out = ["### An undeclared reward with the run's scored record (bench/intervals_record.py)", "",
           f"{len(rows)} cases, {R} seeded records each ({seconds:.0f} s), a {RECORD_PROMPTS * RECORD_SAMPLES}-sample record "
           "of the same reward per record. Each cell: coverage of the records given an interval (the share given none); "
           "width: the mean of hi - lo over them.", "",
           "| case | m x G | eval only | no record | record | record unwidened | record widened x1 | record short of the top | "
           "width eval only | width record | width declared |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        c = r["coverage"]
        return ("-" if c != c else f"{c:.3f}") + (f" ({r['withheld']:.2f})" if r["withheld"] > 0 else "")

    for r in sorted(rows, key=lambda r: (r["regime"], r["samples"], r["prompts"])):
        d = r.get("declared", {}).get("width", float("nan"))
        out.append(f"| {r['regime']} | {r['prompts']} x {r['samples']} | {cell(r['eval only'])} | {cell(r['no record'])} | "
                   f"{cell(r['record'])} | {cell(r['record unwidened'])} | {cell(r['record widened x1'])} | "
                   f"{r['record_missed']:.3f} | {r['eval only']['width']:.3g} | "
                   f"{r['record']['width']:.3g} | " + ("-" if d != d else f"{d:.3g}") + " |")
    low = [(name, min((r[name]["coverage"] for r in rows if r[name]["coverage"] == r[name]["coverage"]), default=float("nan")))
           for name in ("eval only", "no record", "record", "record unwidened", "record widened x1")]
    out += ["", "Lowest coverage: " + ", ".join(f"{n} {c:.3f}" for n, c in low) + "."]
    for over in ("declared", "eval only", "record widened x1"):
        ratio = [r["record"]["width"] / r[over]["width"] for r in rows if over in r and r["record"]["width"] == r["record"]["width"]]
        if ratio:
            out.append(f"Width of the record's interval over the {over} one's: median {np.median(ratio):.2f}, "
                       f"range {min(ratio):.2f}-{max(ratio):.2f}.")
    return out + [""]


def main() -> None:
    from bench.workloads import ROOT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1000)
    args = ap.parse_args()
    path = ROOT / OUT_NAME
    res = json.loads(path.read_text()) if path.exists() else {}
    started = time.time()
    res["record"] = record_cases(args.records)
    res["seconds_record"] = round(time.time() - started, 1)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(section(res["record"], res["seconds_record"])))


if __name__ == "__main__":
    main()
