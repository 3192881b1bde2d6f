"""Reading a run without MLflow: per-stage metrics, the run's history, and one iteration's
completions as tables (polars over the Parquet parts).

    grpo inspect RUN --iter 3 --top 5     # best/worst completions, reward per function
    grpo status RUN                       # history() + diagnostics, one line per iteration

The metric names are the ones logged to MLflow (`pipeline.report.tracking`), named as TRL users know
them; every number is derived from the artifacts, so the run directory alone is the record.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from pipeline.errors import GRPOError
from pipeline.eval.run import eval_summary
from pipeline.report.columns import data_columns, shown_values
from pipeline.report.episodes import episode_metrics, episode_records, episode_texts
from pipeline.run.run import Run
from pipeline.store import STAGES, stage_rel
from schemas.artifacts import (BY_KIND, EXTRA_PREFIX, LOGPROBS, OLD_LOGPROBS, REWARD_PREFIX, ROLLOUT_CORRECTION_METRICS,
                              UPDATE_METRICS, SchemaError)

TRACKED_STAGES = (*STAGES, "eval")
"""Stages whose manifests carry metrics; `eval` of policy k is logged at iteration k."""

UPDATE_STEP_METRICS = ("loss/policy", "clip/ratio_low", "clip/ratio_high", "clip/ratio_region", "ratio/mean",
                       "kl/mean", "entropy/mean", "grad_norm", "lr", *ROLLOUT_CORRECTION_METRICS)


def read_columns(run: Run, k: int, stage: str, columns: list[str]) -> pl.DataFrame:
    """Only `columns` of the parts listed in a stage's manifest (schema-checked, errors name the file): a
    projection keeps `status` and the plots cheap, the token-id columns never loaded."""
    m = run.manifest(k, stage)
    if m is None:
        raise GRPOError(f"iteration {k}: {stage} is not done")
    schema = BY_KIND[stage]
    names = [n for n in sorted(m.outputs) if n.endswith(".parquet")]
    frames = []
    for name in names:
        rel = f"{stage_rel(k, stage)}/{name}"
        with run.store.fs.open(run.store.path(rel), "rb") as f:
            pf = pq.ParquetFile(f)
            try:
                schema.check(pf.schema_arrow, run.store.display(rel))
            except SchemaError as err:
                raise GRPOError(str(err)) from None
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise GRPOError(f"{run.store.display(rel)}: missing column {missing[0]!r}")
            frames.append(pl.from_arrow(pf.read(columns=columns)))
    return pl.concat(frames) if frames else pl.DataFrame()


def read_extras(run: Run, k: int) -> pl.DataFrame:
    """Iteration k's log_extra columns (`extra_<column>` in the score parts; a part whose reward
    functions did not log a column has nulls there), keyed by (prompt_id, sample_idx)."""
    m = run.manifest(k, "score")
    frames = []
    for name in sorted(m.outputs):
        rel = f"{stage_rel(k, 'score')}/{name}"
        with run.store.fs.open(run.store.path(rel), "rb") as f:
            pf = pq.ParquetFile(f)
            cols = ["prompt_id", "sample_idx", *[c for c in pf.schema_arrow.names if c.startswith(EXTRA_PREFIX)]]
            frames.append(pl.from_arrow(pf.read(columns=cols)))
    return pl.concat(frames, how="diagonal_relaxed")


def _f(x) -> float:
    """A plain float; None (an empty or all-null column) becomes NaN."""
    return float("nan") if x is None else float(x)


def _seconds(m) -> float:
    return float(m.timings.get("seconds", float("nan")))


def _per_s(amount: float, seconds: float) -> float:
    return amount / seconds if seconds and seconds > 0 else float("nan")


def reward_names(run: Run) -> list[str]:
    return [r.column for r in run.cfg.rewards]


# -- metrics of one stage --------------------------------------------------------------------
_DONE: dict[tuple, dict[str, float]] = {}


def stage_metrics(run: Run, k: int, stage: str, kept: bool = False) -> dict[str, float]:
    """The iteration-level metrics one stage's artifacts give ({} when the stage is not done). `kept`: by the
    manifest's text, from `_DONE` (`grpo iterate`, which reads the history after every update for its
    diagnostics, every earlier iteration's parts again: 0.5 s by the demo's 24th; a done stage's parts are final)."""
    m = run.manifest(k, stage)
    if m is None:
        return {}
    key = (run.store.display(), k, stage, m.model_dump_json())
    if not kept or key not in _DONE:
        _DONE[key] = {"rollout": _rollout, "score": _score, "logprobs": _logprobs, "update": _update, "eval": _eval}[stage](run, k, m)
    return dict(_DONE[key])


def _rollout(run: Run, k: int, m: dict) -> dict[str, float]:
    df = read_columns(run, k, "rollout", ["completion_length", "truncated"])
    length, clipped = df["completion_length"], df["truncated"]
    terminated = length.filter(~clipped)
    stats = m.stats or {}
    stale = {} if m.staleness is None else {"rollout/staleness": float(m.staleness)}  # train.max_staleness > 0 only
    return {
        **stale,
        "completions/mean_length": _f(length.mean()),
        "completions/min_length": _f(length.min()),
        "completions/max_length": _f(length.max()),
        "completions/mean_terminated_length": _f(terminated.mean()),
        "completions/clipped_ratio": _f(clipped.mean()),
        "time/rollout_s": _seconds(m),
        "tokens_per_s/rollout": _per_s(stats.get("tokens", 0), stats.get("generate_s", 0.0)),
        **episode_metrics(episode_records(run, k)),  # multi-turn episodes only: turns, endings, tool calls
        **worker_metrics("rollout", m.workers),  # the Ray executor only
    }


def _score(run: Run, k: int, m: dict) -> dict[str, float]:
    names = reward_names(run)
    df = read_columns(run, k, "score", ["group_idx", "reward", "group_std", "zero_std", *[REWARD_PREFIX + n for n in names]])
    groups = df.group_by("group_idx").agg(pl.col("group_std").first(), pl.col("zero_std").first())
    out = {
        "reward/mean": _f(df["reward"].fill_nan(None).mean()),
        # TRL's reward_std: the mean within-group std, i.e. how much signal the advantages carry
        "reward/std": _f(groups["group_std"].fill_nan(None).mean()),
        "frac_reward_zero_std": _f(groups["zero_std"].mean()),
    }
    for n in names:
        col = df[REWARD_PREFIX + n].fill_nan(None)  # a reward function's None is stored as null
        out[f"rewards/{n}/mean"] = _f(col.mean())
        out[f"rewards/{n}/std"] = _f(col.std())
        out[f"rewards/{n}/frac_null"] = _f(col.is_null().mean())
    for name, value in (m.reward_metrics or {}).items():  # log_metric: the iteration's mean, named as logged
        out[name] = _f(value)
    out.update(_judge_counts(m.judge, "judge"))
    out.update(worker_metrics("score", m.workers))
    out["time/score_s"] = _seconds(m)
    return out


def worker_metrics(stage: str, record: dict | None) -> dict[str, float]:
    """cluster/<stage>/workers, straggler_s and worker_s/<node>-<pid> from a manifest's `workers`."""
    if not record:
        return {}
    out = {f"cluster/{stage}/workers": float(len(record["seconds"])),
           f"cluster/{stage}/straggler_s": _f(record["straggler"]["seconds"])}
    for worker, seconds in record["seconds"].items():
        out[f"cluster/{stage}/worker_s/{worker.replace('/', '-')}"] = _f(seconds)
    return out


def _judge_counts(judge: dict | None, prefix: str) -> dict[str, float]:
    """PREFIX/<reward>/requests, calls, retries, failures, latency_s, tokens, ... of a stage's served rewards."""
    out = {}
    for n, counts in (judge or {}).items():
        for key, value in counts.items():
            if key != "reasons":
                out[f"{prefix}/{n}/{key}"] = _f(value)
        if counts.get("calls"):
            out[f"{prefix}/{n}/mean_latency_s"] = _f(counts.get("latency_s", 0.0) / counts["calls"])
    return out


def _sampler_gap(df: pl.DataFrame) -> dict[str, float]:
    return {"logprobs/sampler_gap_max": _f(df["sampler_gap_max"].max()), "logprobs/sampler_gap_mean": _f(df["sampler_gap_mean"].mean())}


def _logprobs(run: Run, k: int, m: dict) -> dict[str, float]:
    """The sampler-vs-trainer gap is here unless the update took the old logprobs from its own
    forward (`train.old_logprobs`); then the update reports it."""
    df = read_columns(run, k, "logprobs", ["prompt_id", "sample_idx", "old_logprobs", "sampler_gap_mean", "sampler_gap_max"])
    secs = _seconds(m)
    gap = {**_sampler_gap(df), **_correction(run, k, df)} if df.height and df["sampler_gap_max"].null_count() < df.height else {}
    return {**gap, "time/logprobs_s": secs, "tokens_per_s/logprobs": _per_s((m.stats or {}).get("tokens", 0), secs)}


def update_steps(run: Run, k: int) -> pl.DataFrame:
    """One row per optimizer step of iteration k's update: global `step`, then the metrics."""
    return pl.from_arrow(run.store.read_table(f"{stage_rel(k, 'update')}/metrics.parquet", UPDATE_METRICS))


def _update(run: Run, k: int, m: dict) -> dict[str, float]:
    steps = update_steps(run, k)
    # the iteration's value: the steps' mean, or their min / max for the weight's extremes
    how = {"rollout_correction/ratio_min": "min", "rollout_correction/ratio_max": "max"}
    out = {name: _f(getattr(steps[name].fill_nan(None), how.get(name, "mean"))()) for name in UPDATE_STEP_METRICS if name != "lr"}
    out["lr"] = _f(steps["lr"][-1]) if steps.height else float("nan")  # the rate the iteration ended at
    out["time/update_s"] = _seconds(m)
    out["tokens_per_s/update"] = _per_s(float(steps["tokens"].sum()), float(m.timings.get("train_s", float("nan"))))
    if m.outputs.old_logprobs is not None:  # the update's forward gave the old logprobs: its gap to the sampler's
        df = pl.from_arrow(run.store.read_table(f"{stage_rel(k, 'update')}/{OLD_LOGPROBS}", LOGPROBS))
        out.update({**_sampler_gap(df), **_correction(run, k, df)})
    return out


def _correction(run: Run, k: int, old: pl.DataFrame) -> dict[str, float]:
    """`loss.rollout_correction` on iteration k's completions: the log-weight's quantiles, the share cut."""
    from pipeline.objective.correction import iteration_stats

    rollout = read_columns(run, k, "rollout", ["prompt_id", "sample_idx", "sampler_logprobs", "completion_mask"])
    rows = old.select("prompt_id", "sample_idx", "old_logprobs").join(rollout, on=["prompt_id", "sample_idx"], how="inner",
                                                                       maintain_order="left")
    return iteration_stats(rows, run.cfg.loss.rollout_correction)


def _eval(run: Run, k: int, m: dict) -> dict[str, float]:
    # every figure with its interval (pipeline/eval/metrics.py), the eval's own calls to served rewards
    return {**eval_summary(run, k), **_judge_counts(m.judge, "eval/judge"), "time/eval_s": _seconds(m)}


def history(run: Run, kept: bool = False) -> list[dict]:
    """One row per iteration with every stage metric (`kept`: see stage_metrics); row k holds policy k's eval."""
    last = max(run.iterations() + [run.completed_iters()])
    rows = []
    for k in range(last + 1):
        row: dict = {"iteration": k, "done": [s for s in TRACKED_STAGES if run.done(k, s)]}
        for stage in row["done"]:
            row.update(stage_metrics(run, k, stage, kept))
        secs = [row[f"time/{s}_s"] for s in STAGES if f"time/{s}_s" in row]
        row["seconds"] = float(sum(secs)) if secs else float("nan")  # the iteration's four stages
        rows.append(row)
    return rows


# -- one iteration's completions ---------------------------------------------------------------
def prompt_text(prompt_raw: str) -> str:
    """The dataset's prompt as a person reads it: the string, or the last user message."""
    raw = json.loads(prompt_raw)
    if isinstance(raw, str):
        return raw
    users = [m.get("content", "") for m in raw if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else raw[-1].get("content", "") if raw else "")


def completions(run: Run, k: int, data_columns: list[str] = ()) -> pl.DataFrame:
    """Iteration k's rollout (with these dataset columns) joined with its scores on (prompt_id, sample_idx)."""
    if not run.done(k, "score"):
        done = [s for s in STAGES if run.done(k, s)]
        raise GRPOError(f"iteration {k}: score is not done (done: {', '.join(done) or 'nothing'}); nothing to inspect yet")
    names = reward_names(run)
    roll = read_columns(run, k, "rollout", ["prompt_id", "sample_idx", "group_idx", "prompt_raw", "completion",
                                            "completion_length", "finish_reason", *data_columns])
    score = read_columns(run, k, "score", ["prompt_id", "sample_idx", "reward", "advantage", "group_std", "zero_std",
                                           *[REWARD_PREFIX + n for n in names]])
    if run.cfg.rollout.agentic:  # an episode shows as its conversation
        roll = roll.join(episode_texts(run, k), on=["prompt_id", "sample_idx"], how="left").with_columns(
            pl.coalesce("conversation", "completion").alias("completion")).drop("conversation")
    df = roll.join(score, on=["prompt_id", "sample_idx"], how="inner")
    df = df.join(read_extras(run, k), on=["prompt_id", "sample_idx"], how="left")
    prompts = {raw: prompt_text(raw) for raw in df["prompt_raw"].unique().to_list()}
    df = df.with_columns(pl.col("prompt_raw").replace_strict(prompts, return_dtype=pl.String).alias("prompt"))
    return df.with_columns(pl.col(pl.Float32, pl.Float64).fill_nan(None)).sort("group_idx", "sample_idx")


def _rows(df: pl.DataFrame, names: list[str], shown: list[str] = ()) -> list[dict]:
    out = []
    cols = shown_values(df, shown)
    for i, r in enumerate(df.iter_rows(named=True)):
        out.append({
            "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"], "prompt": r["prompt"], "completion": r["completion"],
            "reward": r["reward"], "rewards": {n: r[REWARD_PREFIX + n] for n in names}, "advantage": r["advantage"],
            "completion_length": r["completion_length"], "finish_reason": r["finish_reason"],
            # a judge's answer beside the completion (pipeline/rewards/judge), and why it gave no reward
            "judges": {n: {"answer": r[f"{EXTRA_PREFIX}{n}_answer"], "reason": r.get(f"{EXTRA_PREFIX}{n}_reason")}
                       for n in names if f"{EXTRA_PREFIX}{n}_answer" in r},
            **({"columns": {c: v[i] for c, v in cols.items()}} if shown else {}),
        })
    return out


def inspect_iteration(run: Run, k: int, top: int = 5, shown: list[str] = ()) -> dict:
    """Best and worst completions with rewards and advantages, reward per function, zero-spread groups;
    `shown`: dataset columns (or dotted paths into them, `reward_model.ground_truth`) beside each completion."""
    names = reward_names(run)
    df = completions(run, k, data_columns(run, k, shown))
    key = ["reward", "advantage", "prompt_id", "sample_idx"]
    best = df.sort(key, descending=[True, True, False, False], nulls_last=True).head(top)
    worst = df.sort(key, descending=[False, False, False, False], nulls_last=True).head(top)
    groups = df.group_by("group_idx", maintain_order=True).agg(
        pl.col("prompt_id").first(), pl.col("prompt").first(), pl.col("zero_std").first(), pl.col("reward").first(),
    )
    zero = groups.filter(pl.col("zero_std"))
    per_fn = {}
    for n in names:
        col = df[REWARD_PREFIX + n]
        per_fn[n] = {"mean": _f(col.mean()), "std": _f(col.std()), "null": int(col.is_null().sum())}
    return {
        "run": run.store.display(),
        "iteration": k,
        "completions": df.height,
        "groups": groups.height,
        "reward": {"mean": _f(df["reward"].mean()), "std": _f(df["reward"].std())},
        "rewards": per_fn,
        "frac_reward_zero_std": zero.height / groups.height if groups.height else float("nan"),
        "zero_std_groups": [{"group_idx": r["group_idx"], "prompt_id": r["prompt_id"], "prompt": r["prompt"], "reward": r["reward"]}
                            for r in zero.iter_rows(named=True)],
        **({"shown": list(shown)} if shown else {}),
        "best": _rows(best, names, shown),
        "worst": _rows(worst, names, shown),
    }


def completion_sample(run: Run, k: int, n: int) -> pl.DataFrame:
    """About `n` completions of iteration k, whole groups (advantages read against their group),
    groups drawn with a seed so a re-log picks the same ones."""
    names = reward_names(run)
    df = completions(run, k)
    G = run.cfg.rollout.num_generations
    groups = df["group_idx"].unique().sort().to_numpy()
    take = min(len(groups), max(1, math.ceil(n / G)))
    chosen = np.sort(np.random.default_rng([run.cfg.seed, k]).choice(groups, size=take, replace=False))
    picked = df.filter(pl.col("group_idx").is_in(chosen.tolist())).head(n)
    extras = [pl.col(c).alias(c[len(EXTRA_PREFIX):]) for c in picked.columns if c.startswith(EXTRA_PREFIX)]
    return picked.select(
        pl.lit(k).alias("iteration"), "prompt_id", "sample_idx", "prompt", "completion",
        "reward", *[REWARD_PREFIX + x for x in names], "advantage", *extras,  # log_extra columns under their own names, as TRL
    )


def latest_scored(run: Run) -> int:
    """The newest iteration whose score stage is done."""
    done = [k for k in run.iterations() if run.done(k, "score")]
    if not done:
        raise GRPOError(f"{run.store.display()}: no iteration has been scored yet")
    return done[-1]


def json_safe(obj):
    """NaN and inf become null, so `--format json` output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


__all__ = ["read_columns", "stage_metrics", "update_steps", "history", "completions", "inspect_iteration",
           "completion_sample", "latest_scored", "prompt_text", "json_safe", "TRACKED_STAGES"]
