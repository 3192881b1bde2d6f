"""The range a reward figure without a declared range took over the run's own record, for its interval's span.

An eval of 3 prompts x 1 sample of a -1/+1 reward, all three at +1, says nothing of where the other value lies,
and no span taken from those samples alone can cover at every shape (Bahadur and Savage: bench/intervals.py
measured 0.750 at 3 prompts, 0.886 at 4). The run's score stage has seen the same reward functions on
thousands of samples: the least and largest value each took there is what `span` (pipeline/eval/metrics.py)
joins to the eval's own samples before widening them (intervals.widened).

    eval figure       score parts' column
    reward            reward            (the weighted total: combine_rewards, as the eval's `reward`)
    rewards/<name>    reward_<name>     (one reward function's value, null where it does not apply)

Only the figures nothing declares a range for are read (metrics.declared_span None), only those columns of
every part listed in a done score stage's manifest (a projection: no prompt, completion or token column is
loaded). What was taken is recorded in the eval's manifest (`observed`: the iterations, the samples and each
figure's [lo, hi]), so `grpo audit` recomputes the intervals from it, and checks it against the parts.
"""

from __future__ import annotations

import math

import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.eval.metrics import declared_span
from pipeline.store import stage_rel
from schemas.artifacts import REWARD_PREFIX


def undeclared(cfg) -> dict[str, str]:
    """{eval figure: score column} of the reward figures whose range nothing declares."""
    figs = {"reward": "reward", **{"rewards/" + r.column: REWARD_PREFIX + r.column for r in cfg.rewards}}
    return {f: c for f, c in figs.items() if declared_span(cfg, f) is None}


def observed(run, iterations: list[int] | None = None) -> dict | None:
    """{"iterations": [...], "samples": n, "ranges": {figure: [lo, hi]}} over the scored samples of `iterations`
    (None: every iteration whose score stage is done), or None: no undeclared figure, or no scored sample."""
    cols = undeclared(run.cfg)
    if not cols:
        return None
    if iterations is None:
        iterations = [k for k in run.iterations() if run.done(k, "score")]
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    samples = 0
    used = []
    for k in iterations:
        m = run.manifest(k, "score")
        if m is None:
            continue
        used.append(k)
        for name in sorted(m.outputs):
            rel = f"{stage_rel(k, 'score')}/{name}"
            with run.store.fs.open(run.store.path(rel), "rb") as f:
                pf = pq.ParquetFile(f)
                have = [c for c in dict.fromkeys(cols.values()) if c in pf.schema_arrow.names]
                table = pf.read(columns=have)
            samples += table.num_rows
            for c in have:
                ends = pc.min_max(pc.if_else(pc.is_nan(table[c]), None, table[c]))
                a, b = ends["min"].as_py(), ends["max"].as_py()
                if a is not None and math.isfinite(a) and math.isfinite(b):
                    lo[c], hi[c] = min(lo.get(c, a), a), max(hi.get(c, b), b)
    ranges = {f: [lo[c], hi[c]] for f, c in cols.items() if c in lo}
    if not ranges:
        return None
    return {"iterations": used, "samples": samples, "ranges": ranges}
