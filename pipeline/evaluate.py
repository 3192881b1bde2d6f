"""Held-out evaluation of policy K on data.eval: greedy (or sampled) completions scored by the
run's reward functions; accuracy = share of completions whose `eval.reward` column is > 0.

    policy/iter-K + data.eval -> iter-K/eval/part-00000.parquet + MANIFEST.json

A served reward (a judge, a served reward model) is recorded as in the score stage: each request
and its answer are `extra_<reward>_*` columns of the eval part (as is every log_extra column), its
counts the manifest's `judge` field, and new answers are cached in iter-K/eval/judge-cache/ as they
arrive, so an eval killed halfway asks only the rest; `grpo audit` re-reads them.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa

from pipeline import advantages
from pipeline.data import derive_seed, load_dataset, make_prompts
from pipeline.models.engines import model_context
from pipeline.errors import GRPOError
from pipeline.store.parts import Shard, run_parts
from pipeline.rewards.calls import RewardLog
from pipeline.rewards.contract import compute_rewards
from pipeline.rollout import policy_engine
from pipeline.store.run import Run
from pipeline.score import completion_masks, drop_cache, extra_column, judge_summary, judging, served, trl_inputs
from pipeline.store import policy_rel
from schemas.artifacts import EVAL, EXTRA_PREFIX, REWARD_PREFIX


def eval_table(run: Run, k: int, engine) -> pa.Table:
    cfg = run.cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run.plain_dir(k))
    df = load_dataset(cfg.data.eval, cfg.data.prompt_column, cfg.data.prompt_template, cfg.rollout.environment is not None)
    ids = list(range(min(df.height, cfg.eval.max_prompts)))
    context = model_context(run.plain_dir(k))
    prompts = make_prompts(df, ids, tok, cfg.data, cfg.data.eval, context - cfg.rollout.max_new_tokens)
    seeds = [derive_seed(cfg.seed, k, p.prompt_id, 1) for p in prompts]
    if cfg.rollout.agentic:  # held-out episodes, with the run's tools and environment
        rows = _episode_rows(run, k, engine, tok, prompts, seeds)
    else:
        samples = engine.generate([p.ids for p in prompts], seeds, n=1, greedy=cfg.eval.greedy)
        rows = []
        for p, group in zip(prompts, samples):
            s = group[0]
            rows.append({"prompt_id": p.prompt_id, "prompt": p.text, "prompt_raw": _json(p.raw), "completion": s.text,
                         "completion_ids": s.token_ids, "completion_length": len(s.token_ids), **p.columns})
    table = pa.Table.from_pylist(rows)
    prompts_, completions, completion_ids, columns = trl_inputs(table, cfg.data.system_prompt, cfg.rollout.environment)
    log = RewardLog(len(completions))
    with judging(run, k, "eval") as ledger:  # a served reward's requests and answers, recorded as in score
        per_fn = compute_rewards(cfg.rewards, prompts_, completions, completion_ids, columns, iteration=k, log=log,
                                 completion_masks=completion_masks(table))  # [N, F]
    names = [r.column for r in cfg.rewards]
    if cfg.eval.reward not in names:  # the config checks this only when eval.every > 0; `grpo eval` runs it anyway
        raise GRPOError(f"eval.reward {cfg.eval.reward!r}: no reward named so (rewards: {', '.join(names)})")
    hit = per_fn[:, names.index(cfg.eval.reward)]
    weights = np.array([r.weight for r in cfg.rewards], dtype=np.float64)
    total = advantages.combine_rewards(per_fn, weights)  # [N], as score: NaN where none applies
    out = {
        "prompt_id": table.column("prompt_id"),
        "prompt": table.column("prompt"),
        "completion": table.column("completion"),
        "completion_length": table.column("completion_length"),
        "reward": pa.array(total, from_pandas=True),
        "correct": pa.array(np.nan_to_num(hit, nan=0.0) > 0),
    }
    for j, n in enumerate(names):
        out[REWARD_PREFIX + n] = pa.array(per_fn[:, j], from_pandas=True)
    if "episode" in table.column_names:
        out["episode"] = table.column("episode")
    for name, values in sorted(log.extra.items()):
        out[EXTRA_PREFIX + name] = extra_column(values)
    if ledger is None:
        return pa.table(out)
    ledger.save_stats("eval")  # the calls it took, beside the cache (pipeline.rewards.judge.record)
    return pa.table(out).replace_schema_metadata({b"grpo.judge": json.dumps(ledger.summary("recorded"), sort_keys=True)})


def _episode_rows(run: Run, k: int, engine, tok, prompts, seeds) -> list[dict]:
    """One episode per eval prompt (greedy with eval.greedy), as rollout runs them."""
    from pipeline.agents.episode import EpisodeRunner
    from pipeline.agents.setup import load_agents
    from pipeline.rollout import engine_max_len

    cfg = run.cfg
    agents = load_agents(cfg.rollout, tok, run.plain_dir(k), cfg.model)
    room = engine_max_len(cfg, model_context(run.plain_dir(k))) - cfg.rollout.episode_tokens()
    runner = EpisodeRunner(agents, tok, cfg.rollout, cfg.data, room, greedy=cfg.eval.greedy)
    episodes = [runner.start(p, i, 0, seed, f"{cfg.data.eval} row {p.prompt_id}") for i, (p, seed) in enumerate(zip(prompts, seeds))]
    runner.run(engine, episodes)
    # completion_length: the model's tokens, as in the rollout (eval/mean_length counts what it wrote)
    keep = ("prompt_id", "prompt", "prompt_raw", "completion", "completion_ids", "completion_mask", "completion_length", "episode")
    return [{c: row[c] for c in keep} | e.prompt.columns for e in episodes for row in [runner.row(e, "")]]


def _json(raw):
    import json

    return json.dumps(raw, ensure_ascii=False)


def run_eval(run: Run, k: int, engine=None) -> dict | None:
    """Evaluate policy k (skipped when data.eval is unset); `engine` may be a warm one holding policy k."""
    cfg = run.cfg
    if cfg.data.eval is None:
        return None
    if run.done(k, "eval"):
        return run.manifest(k, "eval")
    owned = engine is None
    stats = {}

    def make_part(_: int) -> pa.Table:
        nonlocal engine
        t = time.time()
        if engine is None:
            engine = policy_engine(run, k, where=f"eval of policy {k}")
        table = eval_table(run, k, engine)
        stats["seconds"] = round(time.time() - t, 3)
        return table

    def extra() -> dict:
        recorded = {}
        if served(cfg):  # what audit needs to re-read the answers, and the calls they took
            recorded = {"rewards": [r.model_dump(mode="json") for r in cfg.rewards],
                        **({"judge": j} if (j := judge_summary(run, k, 1, "eval")) is not None else {})}
        return {"policy_hash": run.policy_hash(k), "stats": stats, **recorded}

    try:
        inputs = {"policy": {"path": policy_rel(k), "policy_hash": run.policy_hash(k)}, "data": cfg.data.eval}
        m = run_parts(run, k, "eval", EVAL, 1, Shard(), inputs, make_part, manifest_extra=extra)
        if m is not None:
            drop_cache(run, k, "eval")
        return m
    finally:
        if owned and engine is not None:
            engine.close()


def eval_summary(run: Run, k: int) -> dict | None:
    """accuracy, mean reward and mean length of policy k's eval (and its tool use, for episodes), or None."""
    if not run.done(k, "eval"):
        return None
    from pipeline.report.episodes import eval_episode_metrics
    from pipeline.store.parts import read_parts

    t = pa.concat_tables(read_parts(run, k, "eval", EVAL))
    return {
        "eval/accuracy": float(np.mean(t.column("correct").to_numpy(zero_copy_only=False))),
        "eval/reward": float(np.nanmean(t.column("reward").to_numpy(zero_copy_only=False).astype(float))),
        "eval/mean_length": float(np.mean(t.column("completion_length").to_numpy())),
        **eval_episode_metrics(t),
    }
