"""Stage 2: score each completion with the reward functions and turn rewards into advantages.

    iter-k/rollout/part-p.parquet --rewards--> iter-k/score/part-p.parquet + MANIFEST.json

Advantages are group-relative (`pipeline.objective.advantages.group_advantages`), so a part (whole groups)
is scored on its own; `advantages.scale: batch` and `batch_renorm` need every group of the
iteration and so are computed unsharded.
"""

from __future__ import annotations

import contextlib
import json
import numbers

import numpy as np
import pyarrow as pa

from pipeline.objective import advantages
from pipeline.data.prompts import as_messages, dataset_num_rows
from pipeline.errors import GRPOError
from pipeline.run.parts import Shard, read_part, read_parts, run_parts, upstream
from pipeline.rewards.calls import RewardLog, TrainerState, trainer_state_at
from pipeline.rewards.contract import compute_rewards, run_code
from pipeline.run.run import Run
from pipeline.store import part_name, stage_rel
from schemas.artifacts import EXTRA_PREFIX, REWARD_PREFIX, ROLLOUT, SCORE


def trl_inputs(rollout: pa.Table, system_prompt: str | None, environment: str | dict | None = None) -> tuple[list, list, list, dict]:
    """prompts, completions, completion_ids and dataset columns in TRL's reward contract:
    message lists for chat prompts, plain strings otherwise. An episode (tools, environments)
    is its conversation after the prompt, as TRL 1.16 passes it (pipeline.agents.episode.
    trl_completion), its prompt the messages the model saw (with the environment's observation);
    with `rollout.environment`, `environments` carries each episode's instance, rebuilt from its
    recorded state (pipeline.agents.environment), as TRL passes its live ones; with endpoint agents,
    `agent_results` carries each one's result file as recorded (pipeline.agents.endpoint.result)."""
    raws = [json.loads(r) for r in rollout.column("prompt_raw").to_pylist()]
    texts = rollout.column("completion").to_pylist()
    chat = [not isinstance(r, str) for r in raws]
    prompts = [as_messages(r, system_prompt) if c else r for r, c in zip(raws, chat)]
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    extra = [c for c in rollout.column_names if c not in ROLLOUT.schema.names]
    columns = {c: rollout.column(c).to_pylist() for c in extra}
    episodes = rollout.column("episode").to_pylist() if "episode" in rollout.column_names else []
    if any(e is not None for e in episodes):
        from pipeline.agents import environment as envs
        from pipeline.agents.episode import trl_completion

        records = [None if e is None else json.loads(e) for e in episodes]
        for i, rec in enumerate(records):
            if rec is not None:
                prompts[i] = as_messages(envs.observe(raws[i], rec.get("observation")), system_prompt)
                completions[i] = trl_completion(rec)
        if environment is not None:
            columns["environments"] = envs.instances(environment, records)  # one class, or the mapping's by name
        if any(rec is not None and rec.get("route") == "endpoint" for rec in records):
            from pipeline.agents.endpoint.result import agent_results

            columns["agent_results"] = agent_results(records)  # each agent's own reward and metrics (its result file)
    return prompts, completions, rollout.column("completion_ids").to_pylist(), columns


def completion_masks(table: pa.Table) -> list | None:
    """The rollout's completion_mask per row (None where every token was sampled): the built-in
    rewards count the model's tokens only."""
    return table.column("completion_mask").to_pylist() if "completion_mask" in table.column_names else None


def trainer_state(run: Run, k: int) -> TrainerState:
    """The `trainer_state` iteration k's reward functions get: the one its rollout recorded (a
    replay's rollout carries its source's), else derived from the iteration and data.train."""
    m = run.require(k, "score", "rollout")
    if m.trainer_state is not None:
        return TrainerState(**m.trainer_state)
    step = m.replayed_from.iteration if m.replayed_from is not None else k
    try:
        n_rows = dataset_num_rows(run.cfg.data.train)
    except GRPOError:
        n_rows = 0
    return trainer_state_at(run.cfg, step, n_rows)


def extra_column(values: list) -> pa.Array:
    """A log_extra column: float64 when every value is a number or None, else strings (str(v))."""
    if all(v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)) for v in values):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([None if v is None else str(v) for v in values], pa.string())


def score_table(run: Run, k: int, rollout: pa.Table, batch_stats: tuple[float, float] | None = None) -> pa.Table:
    cfg = run.cfg
    G = cfg.rollout.num_generations
    with judging(run, k) as ledger, run_code(run):  # a judge's verdict cache and record; the run's reward code
        # inside run_code: the environments rebuilt here are the classes get_reward resolves (the run's copy), or
        # `type(e) is cls` fails for every row and each get_reward is None
        prompts, completions, completion_ids, columns = trl_inputs(rollout, cfg.data.system_prompt, cfg.rollout.environment)
        if "agent_results" in columns and cfg.rollout.agent.verifiers is not None and run.require(k, "score", "rollout").replayed_from:
            from pipeline.agents.endpoint.vf_run import rescore  # a replay: verifiers' Task.score on the recorded traces

            columns["agent_results"] = rescore(cfg.rollout.agent.verifiers, columns["agent_results"], columns["vf_task"])
        log = RewardLog(len(completions))
        per_fn = compute_rewards(cfg.rewards, prompts, completions, completion_ids, columns, iteration=k,
                                 trainer_state=trainer_state(run, k), log=log, completion_masks=completion_masks(rollout),
                                 rendered=rollout.column("prompt").to_pylist(),
                                 recorded=rollout.column("completion").to_pylist())  # [N, F]
    weights = np.array([r.weight for r in cfg.rewards], dtype=np.float64)
    total = advantages.combine_rewards(per_fn, weights)  # [N]
    if not np.isfinite(total[~np.isnan(total)]).all():
        raise GRPOError(f"score iteration {k}: a total reward is infinite")
    a = cfg.advantages
    adv = advantages.advantages_of(a, total, G)
    mean, std, zero = advantages.group_stats(total, G, std=a.std)  # [N/G]
    cols = {
        "prompt_id": rollout.column("prompt_id"),
        "sample_idx": rollout.column("sample_idx"),
        "group_idx": rollout.column("group_idx"),
    }
    for j, spec in enumerate(cfg.rewards):
        cols[REWARD_PREFIX + spec.column] = pa.array(per_fn[:, j], from_pandas=True)  # NaN -> null
    zero_rows = np.repeat(zero, G)
    cols.update(
        reward=pa.array(total, from_pandas=True),
        advantage=pa.array(adv.astype(np.float32)),
        group_mean=pa.array(np.repeat(mean, G)),
        group_std=pa.array(np.repeat(std, G)),
        zero_std=pa.array(zero_rows),
        train=pa.array(~zero_rows if a.dynamic_sampling else np.ones(len(zero_rows), bool)),
    )
    for name, values in sorted(log.extra.items()):
        cols[EXTRA_PREFIX + name] = extra_column(values)
    table = pa.table(cols)
    # log_metric values travel in the part's metadata as [sum, count], so the iteration's mean
    # is taken over every part however many workers wrote them (see reward_metrics)
    meta = {b"grpo.reward_metrics": json.dumps(log.metric_sums())}
    if ledger is not None:  # the served rewards' counts: what the answers say in the part, the calls they took beside it
        meta[b"grpo.judge"] = json.dumps(ledger.summary("recorded"), sort_keys=True)
        ledger.save_stats(rows_key(rollout))
    return table.replace_schema_metadata(meta)


def rows_key(table: pa.Table) -> str:
    """A name for the rows of a part (its prompt ids and sample indices), the same at every attempt."""
    import hashlib

    rows = json.dumps([table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()], default=str)
    return hashlib.sha256(rows.encode()).hexdigest()[:16]


def served(cfg) -> bool:
    """Whether a reward is asked over HTTP with its answers recorded (a judge, a served reward model)."""
    return any(r.served for r in cfg.rewards)


@contextlib.contextmanager
def judging(run: Run, k: int, stage: str = "score"):
    """Around scoring a part of `stage` (score, eval): the served rewards' ledger
    (pipeline.rewards.judge.record) with this stage's answer cache and, for a replayed score stage,
    the answers stored in its source; None without a served reward."""
    if not served(run.cfg):
        yield None
        return
    from pipeline.rewards.judge.record import CACHE_DIR, Ledger, recording

    prior = replay_verdicts(run, k) if stage == "score" else {}
    with recording(Ledger(run.store, f"{stage_rel(k, stage)}/{CACHE_DIR}", prior, stage)) as ledger:
        yield ledger


def replay_verdicts(run: Run, k: int) -> dict[str, dict]:
    """The verdicts stored in the score parts of the iteration a replayed rollout came from
    ({} when it is no replay, or its source was not scored)."""
    from pipeline.rewards.judge.record import stored_records

    link = run.require(k, "score", "rollout").replayed_from
    if link is None:
        return {}
    try:  # a source that is gone or damaged has no verdicts to give: the judge is asked
        src = Run(link.run)
        if not src.done(link.iteration, "score"):
            return {}
        return stored_records(read_parts(src, link.iteration, "score", SCORE))
    except GRPOError:
        return {}


def judge_summary(run: Run, k: int, num_parts: int, stage: str = "score") -> dict | None:
    """The stage's counts of its served rewards: every part's added up, with the calls each part's
    scoring took (its stats file; pipeline.rewards.judge.record), None without one."""
    from pipeline.rewards.judge.record import CACHE_DIR, merge_summaries, stage_stats

    a = run.cfg.advantages
    whole = stage == "score" and (a.scale == "batch" or a.batch_renorm)  # every slice carries the whole iteration's counts
    metas = [run.store.table_meta(f"{stage_rel(k, stage)}/{part_name(p)}") for p in range(1 if whole else num_parts)]
    found = [json.loads(m["judge"]) for m in metas if "judge" in m]
    return merge_summaries(found + stage_stats(run.store, f"{stage_rel(k, stage)}/{CACHE_DIR}")) if found else None


def reward_metrics(run: Run, k: int, num_parts: int) -> dict[str, float]:
    """The iteration's mean of each log_metric name, over every call in every part."""
    sums: dict[str, list[float]] = {}
    for p in range(num_parts):
        meta = run.store.table_meta(f"{stage_rel(k, 'score')}/{part_name(p)}")
        for name, (total, count) in json.loads(meta.get("reward_metrics", "{}")).items():
            acc = sums.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += count
    return {name: total / count for name, (total, count) in sorted(sums.items()) if count}


def run_score(run: Run, k: int, shard: Shard = Shard(), workers: dict | None = None, started: float | None = None) -> dict | None:
    """Score iteration k (this shard's parts; the manifest once every part is in). The Ray executor,
    whose tasks wrote the parts, passes its record of who wrote them (`workers`, kept in the manifest)
    and when it started them (`started`, so the manifest's seconds count the tasks)."""
    if run.done(k, "score"):
        return run.manifest(k, "score")
    rollout_m = run.require(k, "score", "rollout")
    a = run.cfg.advantages
    if shard.count > 1 and (a.scale == "batch" or a.batch_renorm):
        raise GRPOError("--shard: advantages.scale batch / batch_renorm need the whole iteration; run score unsharded")
    num_parts = len(rollout_m.outputs)
    if a.scale == "batch" or a.batch_renorm:
        full = pa.concat_tables([read_part(run, k, "rollout", ROLLOUT, p) for p in range(num_parts)])
        scored = score_table(run, k, full)
        bounds = np.cumsum([0] + [o.rows for _, o in sorted(rollout_m.outputs.items())])

        def make_part(p):  # every slice keeps the whole iteration's metric sums: their mean is unchanged
            return scored.slice(bounds[p], bounds[p + 1] - bounds[p])
    else:

        def make_part(p):
            return score_table(run, k, read_part(run, k, "rollout", ROLLOUT, p))

    inputs = {"rollout": upstream(run, k, "rollout")}
    m = run_parts(
        run, k, "score", SCORE, num_parts, shard, inputs, make_part,
        manifest_extra=lambda: {
            "rewards": [r.model_dump(mode="json") for r in run.cfg.rewards],
            "trainer_state": trainer_state(run, k).to_dict(),
            "reward_metrics": reward_metrics(run, k, num_parts),
            **({"judge": j} if (j := judge_summary(run, k, num_parts)) is not None else {}),
            **({"workers": workers} if workers else {}),
        },
        started=started,
    )
    if m is not None:
        drop_cache(run, k, "score")
    return m


def drop_cache(run: Run, k: int, stage: str) -> None:
    """Once `stage`'s manifest is written every served reward's answer is in its parts: its cache goes."""
    if served(run.cfg):
        from pipeline.rewards.judge.record import CACHE_DIR

        run.store.remove(f"{stage_rel(k, stage)}/{CACHE_DIR}", recursive=True)
