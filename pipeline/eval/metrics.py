"""Every figure of an eval record, with its 95 % interval (docs/tracking.md lists them).

The record is one row per (eval set, prompt, sample): `correct` (the set's accuracy reward > 0),
`reward` (the weighted total), one `reward_<name>` column per reward, `completion_length` (the
model's tokens), and for episodes the `episode` record. A figure is first taken per prompt (the mean
over its k samples), then averaged over prompts; its interval comes from those per-prompt values
(pipeline/eval/intervals.py: on the range the figure can take, `span`).

    accuracy            mean@k: the share of correct samples
    pass_at_<k>         Chen et al.'s unbiased pass@k, for each k of eval.pass_k
    maj_at_<k>          the majority answer of k samples is correct, its expectation over the k-subsets
    reward              the weighted total reward;  rewards/<name>: each reward column
    mean_length         completion length in the model's tokens
    tools/used          episodes: share calling a tool;  episodes/ending/answered: share ending with an answer
    episodes/turns_mean, tools/call_frequency   episodes: model turns, tool calls per episode

Names: eval/<figure> over all sets, eval/<set>/<figure> per named set, each with _lo and _hi.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import numpy as np

from pipeline.eval.intervals import estimate, recorded, widened
from pipeline.eval.stats import MAJ_SEED, clusters, maj_at_k, pass_at_k
from schemas.artifacts import REWARD_PREFIX


_INTEGER = re.compile(r"-?[0-9]{1,15}")


def integer_key(answer: str) -> int | None:
    """A plain integer's value: math-verify holds two plain integers the same exactly when their values
    are equal, so maj@k need not ask it (majority's `key`); None for any other answer."""
    a = answer.strip()
    return int(a) if _INTEGER.fullmatch(a) else None


def answer_rule(cfg, reward: str):
    """(extract, same, key) of the accuracy reward named `reward`: the answer it reads from a completion,
    how it compares two (math-verify for `correct`; exact text for any other reward) and a shortcut
    key that comparison agrees with (pipeline/eval/stats.py: majority)."""
    from pipeline.rewards.answers import answers_match, extract_answer

    spec = next((r for r in cfg.rewards if r.column == reward), None)
    if spec is not None and spec.fn == "correct":
        return extract_answer, answers_match, integer_key

    def extract(text: str) -> str | None:
        found = extract_answer(text)
        return found if found is not None else (text.strip() or None)

    return extract, lambda a, b: a == b, lambda a: a


def groups(table) -> dict[tuple, list[dict]]:
    """Rows by (set, prompt_id), each group's samples in sample order (the record's order otherwise)."""
    cols = [c for c in table.column_names if c not in ("prompt", "completion_ids", "completion_mask", "prompt_raw")]
    out: dict[tuple, list[dict]] = defaultdict(list)
    for row in table.select(cols).to_pylist() if cols else []:
        out[(row.get("eval_set"), row["prompt_id"])].append(row)
    for rows in out.values():
        rows.sort(key=lambda r: r.get("sample_idx") or 0)
    return dict(out)


def per_prompt(cfg, table) -> dict[tuple, dict[str, float]]:
    """Each prompt's value of every figure, keyed by (set, prompt_id)."""
    from pipeline.config.eval import eval_sets

    reward_of = {s.name: s.reward for s in eval_sets(cfg.data.eval, cfg.eval)}
    ks = cfg.eval.ks()
    rules = {}
    out = {}
    for key, rows in groups(table).items():
        n = len(rows)
        hits = [bool(r["correct"]) for r in rows]
        v = {"accuracy": float(np.mean(hits)), "reward": _nanmean([r["reward"] for r in rows]),
             "mean_length": float(np.mean([r["completion_length"] for r in rows]))}
        for c in rows[0]:
            if c.startswith(REWARD_PREFIX):
                v["rewards/" + c[len(REWARD_PREFIX):]] = _nanmean([r[c] for r in rows])
        if ks:
            reward = reward_of.get(key[0], cfg.eval.reward)
            extract, same, key_of = rules.setdefault(reward, answer_rule(cfg, reward))
            labels = clusters([extract(r["completion"] or "") for r in rows], same, key_of)
            for k in ks:
                if k > n:
                    raise ValueError(f"eval.pass_k {k}: prompt {key[1]} has only {n} samples")
                v[f"pass_at_{k}"] = pass_at_k(n, sum(hits), k)
                v[f"maj_at_{k}"] = float(maj_at_k(labels, np.array(hits), k, seed=MAJ_SEED))
        if "episode" in rows[0]:
            v.update(_episodes([json.loads(r["episode"]) for r in rows if r["episode"] is not None]))
        v["#samples"] = float(n)
        for f, c in SPANS.items():  # the range a mean's samples take (its interval's span)
            if c in rows[0]:
                x = [r[c] for r in rows if r[c] is not None and r[c] == r[c]]
                v[f"#lo/{f}"], v[f"#hi/{f}"] = (min(x), max(x)) if x else (np.nan, np.nan)
        for c in rows[0]:
            if c.startswith(REWARD_PREFIX):
                x = [r[c] for r in rows if r[c] is not None and r[c] == r[c]]
                f = "rewards/" + c[len(REWARD_PREFIX):]
                v[f"#lo/{f}"], v[f"#hi/{f}"] = (min(x), max(x)) if x else (np.nan, np.nan)
        out[key] = v
    return out


SPANS = {"reward": "reward", "mean_length": "completion_length"}
"""A mean's column of samples: the range they took, which its interval's span holds (`span`)."""

FIGURES_VERSION = 4
"""How figures() computes an eval record's figures, recorded in its manifest (`figures_version`): 4 is a reward
without a declared range spanned by the range it took over the run's scored samples too (the manifest's
`observed`), and given no interval where the eval alone is too small for one (`no_interval`); 3 the
intervals of issue 64 (Clopper-Pearson for a share, effective-n Clopper-Pearson and the generalised Wilson on
the range a figure can take: docs/tracking.md, 2026-12-01); 2 was maj@k as its expectation over k-subsets with
unanswered samples voting `[invalid]` and the intervals of 2026-11-28; a record without it came from the
first-k maj@k and the percentile bootstrap. Audit recomputes an older record's values (not its intervals),
and a record's maj@k only from version 2 on."""


def _episodes(records: list[dict]) -> dict[str, float]:
    from pipeline.agents.metrics import EVAL_EPISODE_METRICS, episode_metrics

    m = episode_metrics(records)
    return {name: m[name] for name in EVAL_EPISODE_METRICS if name in m}


def _nanmean(values) -> float:
    v = np.array([np.nan if x is None else x for x in values], dtype=np.float64)
    return float(np.nanmean(v)) if np.any(~np.isnan(v)) else float("nan")


def figures(cfg, table, observed: dict | None = None, notes: dict | None = None) -> dict[str, tuple[float, float, float]]:
    """{figure: (value, lo, hi)}: over all sets (`accuracy`), and per named set (`<set>/accuracy`). `observed`: the
    range each undeclared reward figure took over the run's scored samples (pipeline/eval/observed.py: its
    `ranges`); `notes`, when given, gets why each figure with a value has no interval (`no_interval`)."""
    values = per_prompt(cfg, table)
    out = _figures(cfg, values, observed, notes, "")
    names = sorted({key[0] for key in values if key[0] is not None}, key=list(_set_order(cfg)).index)
    for name in names:
        scope = {k: v for k, v in values.items() if k[0] == name}
        out.update({f"{name}/{f}": e for f, e in _figures(cfg, scope, observed, notes, f"{name}/").items()})
    return out


def _set_order(cfg):
    from pipeline.config.eval import eval_sets

    return [s.name for s in eval_sets(cfg.data.eval, cfg.eval)]


def _figures(cfg, values: dict[tuple, dict[str, float]], observed: dict | None = None, notes: dict | None = None,
             prefix: str = "") -> dict[str, tuple[float, float, float]]:
    names = [f for f in dict.fromkeys(f for v in values.values() for f in v) if not f.startswith("#")]
    samples = sum(v["#samples"] for v in values.values())
    out = {}
    for f in names:
        why = no_interval(cfg, values, f, observed)
        e = estimate([v.get(f, np.nan) for v in values.values()], rate=is_rate(f), samples=samples / draws(f),
                     span=span(cfg, values, f, observed))
        if why is not None:
            e = (e[0], float("nan"), float("nan"))
        elif e[0] == e[0] and e[1] != e[1]:
            why = "one prompt: no spread to estimate"
        if why is not None and e[0] == e[0] and notes is not None:
            notes[prefix + f] = why
        out[f] = e
    return out


def draws(figure: str) -> int:
    """The samples one draw of a figure takes: k for pass@k and maj@k, else 1. Its interval counts n samples a
    prompt as n / k independent draws (intervals.estimate's `samples`): a k-sample figure is no share of n coins."""
    k = re.fullmatch(r"(?:pass|maj)_at_(\d+)", figure)
    return int(k.group(1)) if k else 1


def span(cfg, values, f: str, observed: dict | None = None) -> tuple[float, float] | None:
    """The range figure `f` can take, which maps its per-prompt values onto [0, 1] for its interval
    (intervals.estimate): a rate [0, 1]; `mean_length` [0, the completion budget] (rollout.max_new_tokens, an
    episode's whole budget); `reward` the sum of its rewards' declared ranges (`declared`) times their weights,
    `rewards/<name>` that reward's; where a range is not declared (your own function, a served one, a reward
    model's raw logit, without a `range:` in its entry) or the figure is a count, the range its samples took (else its per-prompt values)
    widened (intervals.widened); for a reward the run scored, the range it took over the run's scored samples
    (`observed`: {figure: [lo, hi]}) joined with the eval's, widened less (intervals.recorded). Never narrower
    than what the samples took. None: no values."""
    if is_rate(f):
        return 0.0, 1.0
    known = declared_span(cfg, f)
    scored = known is None and bool(observed) and f in observed  # a declared range is the span, record or not
    seen = _seen(values, f, observed if scored else None)
    if seen is None:
        return None
    if scored:
        known = recorded(*seen)
    a, b = known if known is not None else widened(*seen)
    return min(float(a), seen[0]), max(float(b), seen[1])


def _seen(values, f: str, observed: dict | None = None) -> tuple[float, float] | None:
    """The least and largest value figure f's samples took (else its per-prompt values'), joined with the range
    it took over the run's scored samples where `observed` has it; None: no value."""
    lo = [v[f"#lo/{f}"] for v in values.values() if f"#lo/{f}" in v]
    hi = [v[f"#hi/{f}"] for v in values.values() if f"#hi/{f}" in v]
    if not lo or np.all(np.isnan(lo)):
        lo = hi = [v[f] for v in values.values() if f in v and v[f] == v[f]]
    if not lo:
        return None
    seen = float(np.nanmin(lo)), float(np.nanmax(hi))
    if observed and f in observed:
        seen = min(seen[0], float(observed[f][0])), max(seen[1], float(observed[f][1]))
    return seen


MIN_PROMPTS = 7
"""Below this many prompts a reward figure with neither a declared range nor a scored record gets no interval:
bench/intervals.py's undeclared rewards on their samples' range widened miss 0.93 at 3-5 prompts (a -1/+1 reward
at 0.5: 0.731-0.750 at 3 prompts x 1 sample; a 0-10 score mostly at 0-2: 0.894-0.906 at 5), sit near it at 6
(0.933 and 0.947 in two seeded draws) and hold it from 7 up (0.963-0.964). No count of prompts holds for every
shape: a [0, 1] reward with one sample in 25 at 10 still misses at 7-8 (0.913-0.940; bench/intervals_record.py)."""


def withheld(prompts, lo, hi, scored) -> np.ndarray:
    """Where a reward figure without a declared range gets no interval (vectorised: the bench passes arrays):
    every value it took, the eval's samples joined with the run's scored ones, is one value (nothing says how far
    the others lie), or fewer than MIN_PROMPTS prompts and no scored record (`scored` False)."""
    return (np.asarray(lo) == np.asarray(hi)) | (~np.asarray(scored, dtype=bool) & (np.asarray(prompts) < MIN_PROMPTS))


def no_interval(cfg, values, f: str, observed: dict | None = None) -> str | None:
    """Why reward figure f gets no interval (`withheld`), in a few words for the page; None: it gets one."""
    if not (f == "reward" or f.startswith("rewards/")) or declared_span(cfg, f) is not None:
        return None
    seen = _seen(values, f, observed)
    if seen is None:
        return None
    scored = bool(observed) and f in observed
    m = sum(1 for v in values.values() if f in v and v[f] == v[f])
    if not withheld(m, *seen, scored):
        return None
    if seen[0] == seen[1]:
        return "all samples alike: declare its range for an interval"
    return f"{m} prompt{'s' if m != 1 else ''}, no scored record: declare its range for an interval"


def declared_span(cfg, f: str) -> tuple[float, float] | None:
    """The range figure `f` can take by its definition, or None where nothing declares one."""
    if f == "mean_length":
        return 0.0, float(cfg.rollout.completion_budget())
    specs = {r.column: r for r in cfg.rewards}
    if f.startswith("rewards/"):
        spec = specs.get(f[len("rewards/"):])
        return declared(spec) if spec is not None else None
    if f == "reward":  # the weighted sum of the rewards that apply (one returning None adds nothing: 0)
        parts = [declared(spec) for spec in cfg.rewards]
        if not parts or any(p is None for p in parts):
            return None
        ends = [sorted((s.weight * p[0], s.weight * p[1], 0.0)) for s, p in zip(cfg.rewards, parts)]
        return sum(e[0] for e in ends), sum(e[-1] for e in ends)
    return None


def declared(spec) -> tuple[float, float] | None:
    """The values a reward function can give, where its definition says (pipeline/rewards/builtins.py and
    judge): correct, format, code_tests [0, 1]; contains, length_range [0, value]; overlong [-1, 0]; a judge
    its verdict's [min, max] ([0, 1] normalized; a choice: its values); a reward model with a sigmoid or
    softmax activation [0, 1] (times its sign); any entry's own `range:` first. None: a custom or served
    function, a raw logit, that declares none."""
    if spec.range is not None:
        return float(spec.range[0]), float(spec.range[1])
    fn, kw = spec.fn, spec.kwargs
    if fn in ("correct", "format", "code_tests"):
        return 0.0, 1.0
    if fn in ("contains", "length_range"):
        return min(0.0, kw.value), max(0.0, kw.value)
    if fn == "overlong":
        return -1.0, 0.0
    if fn == "judge":
        v = kw.verdict
        ends = [0.0, 1.0] if v.normalize else [v.min, v.max]
        if v.read == "choice" or (v.read == "boxed" and v.choices):
            ends = list(v.choices.values()) + ([] if v.read == "choice" else ends)
        return float(min(ends)), float(max(ends))
    if fn == "reward_model" and kw.activation != "none":
        return (0.0, 1.0) if kw.sign == 1 else (-1.0, 0.0)
    return None


RATES = re.compile(r"accuracy|(pass|maj)_at_\d+|tools/used|episodes/ending/.+")
"""The figures that are a share of samples (Clopper-Pearson's interval when each prompt's value is 0 or 1); the
others (reward, rewards/*, mean_length, episodes/turns_mean, tools/call_frequency) are means, mapped onto [0, 1]
by the range they can take (`span`) for their interval."""


def is_rate(figure: str) -> bool:
    return RATES.fullmatch(figure) is not None


def flat(figs: dict[str, tuple[float, float, float]], prefix: str = "eval/") -> dict[str, float]:
    """MLflow's names: eval/<figure>, eval/<figure>_lo, eval/<figure>_hi."""
    out = {}
    for f, (v, lo, hi) in figs.items():
        out.update({f"{prefix}{f}": v, f"{prefix}{f}_lo": lo, f"{prefix}{f}_hi": hi})
    return out
