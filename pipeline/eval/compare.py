"""`grpo eval --compare A B`: two eval records on the same prompts, figure by figure.

A and B are runs (or records `grpo eval --model` wrote); each side is the eval of one policy (the
newest evaluated, or `--iter K`). Per figure (pipeline/eval/metrics.py), over the prompts both
evaluated (the same set, prompt id and prompt text, the same number of samples):

    difference B - A of the mean over prompts, the p-value of the paired sign-flip (permutation) test
    over prompts (pipeline/eval/intervals.py: sign_flip_p) and a 95 % interval for the difference (intervals.paired:
    the mean difference's interval on the range a difference of the figure can take, widened to hold 0
    where the test does not reject), the prompts where B's per-prompt value is higher (B wins), where A's is
    (A wins)

and one line on the headline figure (accuracy over all sets): distinguishable from noise only when the
sign-flip test rejects at 5 %, which is exactly when the interval leaves out 0 ("4 of 30 won, none
lost" is p = 0.125, and its interval holds 0). Records sampled with different
eval settings (greedy, samples, temperature, top_p, top_k, min_p, max_new_tokens) are refused.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.errors import GRPOError
from pipeline.eval.metrics import draws, per_prompt, span
from pipeline.eval.intervals import paired, sign_flip_p
from pipeline.run.run import Run
from schemas.artifacts import EVAL


def record(run: Run, k: int | None) -> tuple[int, pa.Table]:
    """(k, the eval table of policy k): the newest evaluated policy when k is None."""
    from pipeline.run.parts import read_parts

    done = [i for i in range(run.completed_iters() + 1) if run.done(i, "eval")]
    if k is None:
        if not done:
            raise GRPOError(f"{run.store.display()}: no evaluated policy (run `grpo eval {run.store.display()}` first)")
        k = done[-1]
    elif k not in done:
        raise GRPOError(f"{run.store.display()}: policy {k} has no eval (run `grpo eval {run.store.display()} --iter {k}` first)")
    return k, pa.concat_tables(read_parts(run, k, "eval", EVAL), promote_options="default")


def _prompts(table: pa.Table) -> dict[tuple, tuple[str, int]]:
    out: dict[tuple, tuple[str, int]] = {}
    sets = table.column("eval_set").to_pylist() if "eval_set" in table.column_names else [None] * table.num_rows
    for s, pid, text in zip(sets, table.column("prompt_id").to_pylist(), table.column("prompt").to_pylist()):
        key = (s, pid)
        out[key] = (text, out.get(key, (text, 0))[1] + 1)
    return out


def compare(a: Run, ka: int, ta: pa.Table, b: Run, kb: int, tb: pa.Table) -> dict:
    """Every figure both records have: {figure: {a, b, diff, lo, hi, a_wins, b_wins}}, and `prompts`."""
    pa_, pb = _prompts(ta), _prompts(tb)
    if set(pa_) != set(pb):
        only = sorted(set(pa_) ^ set(pb), key=str)[0]
        raise GRPOError(f"--compare: the records hold different prompts (set {only[0] or 'eval'}, prompt {only[1]} is in one only); "
                        "compare evals of the same data.eval and eval.max_prompts")
    for key in pa_:
        if pa_[key] != pb[key]:
            what = "text" if pa_[key][0] != pb[key][0] else f"number of samples ({pa_[key][1]} against {pb[key][1]})"
            raise GRPOError(f"--compare: set {key[0] or 'eval'} prompt {key[1]}: the records differ in its {what}")
    _same_sampling(a, b)
    va, vb = per_prompt(a.cfg, ta), per_prompt(b.cfg, tb)
    keys = list(va)
    both = [f for f in dict.fromkeys(f for v in va.values() for f in v)
            if not f.startswith("#") and any(f in v for v in vb.values())]
    out = {}
    sets = sorted({k[0] for k in keys if k[0] is not None})
    for scope in [None, *sets]:
        ks = [k for k in keys if scope is None or k[0] == scope]
        for f in both:
            xa = [va[k].get(f, float("nan")) for k in ks]
            xb = [vb[k].get(f, float("nan")) for k in ks]
            both_sides = {("A", *k): va[k] for k in ks} | {("B", *k): vb[k] for k in ks}
            samples = 2 * sum(va[k]["#samples"] for k in ks) / draws(f)  # a difference takes a sample of each side
            diff, lo, hi = paired(xa, xb, span=span(a.cfg, both_sides, f), samples=samples)
            name = f if scope is None else f"{scope}/{f}"
            d = [y - x for x, y in zip(xa, xb) if x == x and y == y]
            out[name] = {"a": _mean(xa), "b": _mean(xb), "diff": diff, "lo": lo, "hi": hi,
                         "p": float(sign_flip_p(d)[0]) if d else float("nan"),
                         "a_wins": sum(x > y for x, y in zip(xa, xb)), "b_wins": sum(y > x for x, y in zip(xa, xb))}
    return {"a": {"run": a.store.display(), "policy": ka}, "b": {"run": b.store.display(), "policy": kb},
            "prompts": len(keys), "figures": out, "notes": _reward_notes(a.cfg, b.cfg, {k[0] for k in keys})}


def sampling(cfg) -> dict[str, object]:
    """The settings an eval record's completions were sampled with (greedy: only the length limit matters)."""
    r, e = cfg.rollout, cfg.eval
    out = {"eval.greedy": e.greedy, "eval.samples": e.samples, "rollout.max_new_tokens": r.max_new_tokens}
    if not e.greedy:
        out |= {"eval.temperature": e.temperature if e.temperature is not None else r.temperature,
                "rollout.top_p": r.top_p, "rollout.top_k": r.top_k, "rollout.min_p": r.min_p}
    return out


def _same_sampling(a: Run, b: Run) -> None:
    """Refuse two records whose completions were drawn differently: their difference would be the settings'."""
    sa, sb = sampling(a.cfg), sampling(b.cfg)
    for key in sa:
        if sa[key] != sb.get(key):
            raise GRPOError(f"--compare: {a.store.display()} and {b.store.display()} evaluated with different "
                            f"{key} ({sa[key]} against {sb.get(key)}); compare evals sampled alike")


def _reward_notes(ca, cb, sets) -> list[str]:
    """A set whose accuracy the two sides count with different rewards (a --replay with another
    eval.reward): its accuracy, pass@k and maj@k differences are the graders' as much as the policies'."""
    from pipeline.config.eval import eval_sets

    ra = {s.name: s.reward for s in eval_sets(ca.data.eval, ca.eval)}
    rb = {s.name: s.reward for s in eval_sets(cb.data.eval, cb.eval)}
    return [f"note: set {s or 'eval'}: A counts accuracy with reward {ra[s]!r}, B with {rb[s]!r}"
            for s in sorted(sets, key=str) if s in ra and s in rb and ra[s] != rb[s]]


def _mean(x: list[float]) -> float:
    v = [y for y in x if y == y]
    return sum(v) / len(v) if v else float("nan")


def verdict(result: dict, figure: str = "accuracy") -> str:
    """One line: is B - A on `figure` distinguishable from noise (the paired sign-flip test rejects at 5 %)?"""
    f = result["figures"][figure]
    d, lo, hi, p = f["diff"], f["lo"], f["hi"], f["p"]
    head = f"{figure}: B - A = {d:+.3f} [{lo:+.3f}, {hi:+.3f}] over {result['prompts']} prompts"
    if lo != lo or hi != hi:  # NaN: one prompt, no spread to estimate
        return f"{head}: no interval (one prompt); not distinguishable from noise"
    if p <= 0.05:
        return f"{head}: distinguishable from noise, {'B' if d > 0 else 'A'} is better (sign-flip test p = {p:.3g})"
    return f"{head}: not distinguishable from noise (sign-flip test p = {p:.3g})"


def lines(result: dict) -> list[str]:
    """The comparison as a person reads it."""
    a, b = result["a"], result["b"]
    out = [f"A: {a['run']} policy {a['policy']}", f"B: {b['run']} policy {b['policy']}",
           f"{'figure':<28} {'A':>8} {'B':>8} {'B - A':>8} {'95 % interval':>20} {'A wins':>7} {'B wins':>7} {'p':>7}"]
    for name, f in result["figures"].items():
        interval = "[{:+.3f}, {:+.3f}]".format(f["lo"], f["hi"])
        out.append(f"{name:<28} {f['a']:>8.3f} {f['b']:>8.3f} {f['diff']:>+8.3f} {interval:>20} {f['a_wins']:>7} {f['b_wins']:>7} {f['p']:>7.3g}")
    out += result.get("notes", [])
    out.append(verdict(result))
    return out
