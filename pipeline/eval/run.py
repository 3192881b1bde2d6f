"""Held-out evaluation of policy K on data.eval (one set, or several by name): one greedy completion
per prompt, or eval.samples sampled in one engine call (n=k), scored by the run's reward functions;
`correct` = the set's accuracy reward (`eval.reward`, or its own) > 0. The figures (accuracy, pass@k,
maj@k, rewards, lengths, tool use) and their 95 % intervals go into the manifest (pipeline/eval/).

    policy/iter-K + data.eval -> iter-K/eval/part-*.parquet (a part per set, or per eval.prompts_per_part
                                 prompts of it) + MANIFEST.json

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

from pipeline.objective import advantages
from pipeline.data.prompts import dataset_num_rows, derive_seed, load_dataset, make_prompts, prompt_made_up
from pipeline.config.eval import SetRef
from pipeline.config.rules import unknown_eval_reward
from pipeline.eval.metrics import FIGURES_VERSION, figures, flat
from pipeline.eval.observed import observed
from pipeline.models.engines import model_context
from pipeline.run.template_date import dated
from pipeline.errors import GRPOError
from pipeline.run.parts import Shard, read_parts, run_parts
from pipeline.rewards.calls import RewardLog
from pipeline.rewards.contract import compute_rewards, run_code
from pipeline.rollout import policy_engine
from pipeline.run.run import Run
from pipeline.score import completion_masks, drop_cache, extra_column, judge_summary, judging, served, trl_inputs
from pipeline.store import part_name, policy_rel, stage_rel
from schemas.artifacts import EVAL, EXTRA_PREFIX, REWARD_PREFIX


def eval_parts(cfg) -> list[tuple[SetRef, list[int]]]:
    """The eval's parts in order: each set's first eval.max_prompts rows, eval.prompts_per_part a part
    (one part per set by default; a killed eval redoes only the parts it had not written)."""
    parts = []
    for s in cfg.eval_sets():
        n = min(dataset_num_rows(s.path), cfg.eval.max_prompts)
        size = cfg.eval.prompts_per_part or max(n, 1)
        parts += [(s, list(range(a, min(n, a + size)))) for a in range(0, max(n, 1), size)]
    return parts


def eval_table(run: Run, k: int, engine, part: tuple[SetRef, list[int]], recorded: pa.Table | None = None) -> pa.Table:
    """One eval part: its prompts sampled (or, `recorded`, another eval's part of them replayed), scored."""
    cfg = run.cfg
    from pipeline.models.tokenizer_cache import tokenizer_of

    s, ids = part
    tok = dated(tokenizer_of(run.plain_dir(k)), cfg.data.template_date)
    df = load_dataset(s.path, cfg.data.prompt_column, cfg.data.prompt_template, cfg.rollout.environment is not None)
    context = model_context(run.plain_dir(k))
    prompts = make_prompts(df, ids, tok, cfg.data, s.path, context - cfg.rollout.max_new_tokens)
    seeds = [derive_seed(cfg.seed, k, p.prompt_id, 1) for p in prompts]
    n, many = cfg.eval.samples, cfg.eval.samples > 1
    if cfg.eval.temperature is not None:
        engine = _Tempered(engine, cfg.eval.temperature)
    if recorded is not None:
        samples = _replayed(recorded, prompts, n, tok)
    if cfg.rollout.agentic:  # held-out episodes, with the run's tools and environment
        rows = _episode_rows(run, k, engine, tok, prompts, seeds, s.path, n)
    else:
        if recorded is None:
            samples = engine.generate([p.ids for p in prompts], seeds, n=n, greedy=cfg.eval.greedy)  # one call, n=k
        rows = []
        for p, group in zip(prompts, samples):
            for j, smp in enumerate(group):
                rows.append({"prompt_id": p.prompt_id, **({"sample_idx": j} if many else {}), "prompt": p.text,
                             "prompt_raw": _json(p.raw), "completion": smp.text, "completion_ids": smp.token_ids,
                             "completion_length": len(smp.token_ids), **p.columns})
    if recorded is not None:  # the sampled length as recorded (the ids are the text tokenized again)
        for r, length in zip(rows, recorded.column("completion_length").to_pylist()):
            r["completion_length"] = length
    table = pa.Table.from_pylist(rows)
    with judging(run, k, "eval") as ledger, run_code(run):  # a served reward's requests and answers; the run's reward code
        # inside run_code: environments rebuilt from the run's copy, the classes get_reward resolves (as score)
        prompts_, completions, completion_ids, columns = trl_inputs(table, cfg.data.system_prompt, cfg.rollout.environment)
        log = RewardLog(len(completions))
        per_fn = compute_rewards(cfg.rewards, prompts_, completions, completion_ids, columns, iteration=k, log=log,
                                 completion_masks=completion_masks(table),
                                 rendered=table.column("prompt").to_pylist() if "prompt" in table.column_names else None,
                                 recorded=table.column("completion").to_pylist())  # [N, F]
    if why := unknown_eval_reward(cfg, s):  # the config asks only when eval.every > 0; `grpo eval` runs it anyway
        raise GRPOError(why)
    names = [r.column for r in cfg.rewards]
    hit = per_fn[:, names.index(s.reward)]
    weights = np.array([r.weight for r in cfg.rewards], dtype=np.float64)
    total = advantages.combine_rewards(per_fn, weights)  # [N], as score: NaN where none applies
    out = {
        "prompt_id": table.column("prompt_id"),
        **({"eval_set": pa.array([s.name] * table.num_rows, pa.string())} if s.name is not None else {}),
        **({"sample_idx": table.column("sample_idx").cast(pa.int32())} if many else {}),
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


def _replayed(recorded: pa.Table, prompts, n: int, tok) -> list[list]:
    """Another eval's completions of these prompts, as the engine's samples (their ids tokenized again)."""
    from pipeline.models.engine_base import Sample

    rows = recorded.select(["prompt_id", "prompt", "completion"]).to_pylist()
    if [r["prompt_id"] for r in rows] != [p.prompt_id for p in prompts for _ in range(n)] or \
            any(r["prompt"] != p.text for r, p in zip(rows[::n], prompts)):
        raise GRPOError("--replay: the recorded eval holds other prompts than this config evaluates "
                        "(data.eval, eval.max_prompts and eval.prompts_per_part must stay)")
    groups = []
    for i in range(len(prompts)):
        texts = [r["completion"] for r in rows[i * n:(i + 1) * n]]
        groups.append([Sample(t, tok(t, add_special_tokens=False)["input_ids"], [], "stop") for t in texts])
    return groups


class _Tempered:
    """The engine sampling at eval.temperature instead of rollout.temperature."""

    def __init__(self, engine, temperature: float):
        self.engine, self.temperature = engine, temperature

    def generate(self, prompt_ids, seeds, n, greedy=False, max_tokens=None):
        return self.engine.generate(prompt_ids, seeds, n, greedy=greedy, max_tokens=max_tokens, temperature=self.temperature)


def _episode_rows(run: Run, k: int, engine, tok, prompts, seeds, path: str, n: int) -> list[dict]:
    """eval.samples episodes per eval prompt (greedy with eval.greedy), as rollout runs them: tool and
    environment episodes, or an endpoint agent started once per episode (pipeline.agents.endpoint)."""
    from pipeline.agents.episode import EpisodeRunner
    from pipeline.agents.setup import load_agents
    from pipeline.rollout import engine_max_len

    cfg = run.cfg
    with run_code(run):  # the tools and environments the run carries
        agents = load_agents(cfg.rollout, tok, run.plain_dir(k), cfg.model)
        if cfg.rollout.agent is not None:  # an endpoint agent (a command or verifiers'): the run's copies, as in the rollout
            from pipeline.agents.endpoint.runner import EndpointRunner as EpisodeRunner
            from pipeline.agents.endpoint.vf_run import run_argv
            from pipeline.rewards.loading import copy_of

            command = run_argv(cfg.rollout.agent, copy_of)
    room = engine_max_len(cfg, model_context(run.plain_dir(k))) - cfg.rollout.episode_tokens()
    runner = EpisodeRunner(agents, tok, cfg.rollout, cfg.data, room, greedy=cfg.eval.greedy,
                           prompt_given=not prompt_made_up(path, cfg.data, True))
    if cfg.rollout.agent is not None:  # what the records say was used: the engine samples at eval.temperature (_Tempered)
        runner.command, runner.temperature = command, cfg.eval.temperature or cfg.rollout.temperature
    episodes = [runner.start(p, i, j, seed, f"{path} row {p.prompt_id}")
                for i, (p, seed) in enumerate(zip(prompts, seeds)) for j in range(n)]
    runner.run(engine, episodes)
    # completion_length: the model's tokens, as in the rollout (eval/mean_length counts what it wrote)
    keep = ("prompt_id", *(("sample_idx",) if n > 1 else ()), "prompt", "prompt_raw", "completion", "completion_ids",
            "completion_mask", "completion_length", "episode")
    return [{c: row[c] for c in keep} | e.prompt.columns for e in episodes for row in [runner.row(e, "")]]


def _json(raw):
    import json

    return json.dumps(raw, ensure_ascii=False)


def run_eval(run: Run, k: int, engine=None, recorded: list[pa.Table] | None = None, replayed_from: dict | None = None) -> dict | None:
    """Evaluate policy k (skipped when data.eval is unset); `engine` may be a warm one holding policy k.
    `recorded`: another eval's parts, re-scored instead of sampled (pipeline/loop/replay_eval.py)."""
    cfg = run.cfg
    if cfg.data.eval is None:
        return None
    if run.done(k, "eval"):
        return run.manifest(k, "eval")
    owned = engine is None
    stats = {}
    parts = eval_parts(cfg)

    def make_part(p: int) -> pa.Table:
        nonlocal engine
        t = time.time()
        if recorded is not None:
            if len(recorded) != len(parts):
                raise GRPOError(f"--replay: the recorded eval has {len(recorded)} parts, this config makes {len(parts)}")
            return eval_table(run, k, None, parts[p], recorded[p])
        if engine is None:
            engine = policy_engine(run, k, where=f"eval of policy {k}")
        table = eval_table(run, k, engine, parts[p])
        stats["seconds"] = round(stats.get("seconds", 0.0) + time.time() - t, 3)
        return table

    def extra() -> dict:
        recorded = {}
        if served(cfg):  # what audit needs to re-read the answers, and the calls they took
            recorded = {"rewards": [r.model_dump(mode="json") for r in cfg.rewards],
                        **({"judge": j} if (j := judge_summary(run, k, len(parts), "eval")) is not None else {})}
        written = [run.store.read_table(f"{stage_rel(k, 'eval')}/{part_name(p)}", EVAL) for p in range(len(parts))]
        seen, notes = observed(run), {}  # the undeclared rewards' range over the run's scored samples
        figs = figures(cfg, pa.concat_tables(written, promote_options="default"), seen and seen["ranges"], notes)
        return {"policy_hash": run.policy_hash(k), "stats": stats, **recorded,
                "metrics": {f: {"value": v, "lo": lo, "hi": hi} for f, (v, lo, hi) in figs.items()},
                "figures_version": FIGURES_VERSION, **({"observed": seen} if seen else {}),
                **({"no_interval": notes} if notes else {})}

    try:
        data = cfg.data.eval if isinstance(cfg.data.eval, str) else cfg.model_dump(mode="json")["data"]["eval"]
        inputs = {"policy": {"path": policy_rel(k), "policy_hash": run.policy_hash(k)}, "data": data,
                  **({"replayed_from": replayed_from} if replayed_from else {})}
        m = run_parts(run, k, "eval", EVAL, len(parts), Shard(), inputs, make_part, manifest_extra=extra)
        if m is not None:
            drop_cache(run, k, "eval")
        return m
    finally:
        if owned and engine is not None:
            engine.close()


def eval_figures(run: Run, k: int) -> dict[str, tuple[float, float, float]] | None:
    """Every figure of policy k's eval with its 95 % interval (pipeline/eval/metrics.py), or None:
    as its manifest recorded them, or computed from its parts (an eval recorded before they were)."""
    m = run.manifest(k, "eval")
    if m is None:
        return None
    if m.metrics is not None:
        return {f: (e["value"], e["lo"], e["hi"]) for f, e in m.metrics.items()}
    return figures(run.cfg, pa.concat_tables(read_parts(run, k, "eval", EVAL), promote_options="default"))


def eval_notes(run: Run, k: int) -> dict[str, str]:
    """Why each figure of policy k's eval that has a value has no interval ({} where every one has)."""
    m = run.manifest(k, "eval")
    return dict(m.no_interval or {}) if m is not None else {}


def eval_summary(run: Run, k: int) -> dict | None:
    """eval/<figure> (and _lo, _hi) of policy k's eval: accuracy, reward, mean length, pass@k, maj@k,
    tool use for episodes; per named set eval/<set>/<figure>; None when not evaluated."""
    figs = eval_figures(run, k)
    return None if figs is None else flat(figs)
