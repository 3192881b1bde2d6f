"""Stage 1: sample G completions for each of iteration k's prompts from its behaviour policy
b(k): policy k, or with train.max_staleness s the policy max(0, k - s) (pipeline/schedule.py).

    prompts(data.train, seed, k) --policy/iter-b(k)--> iter-k/rollout/part-*.parquet + MANIFEST.json
"""

from __future__ import annotations

import time
from functools import cached_property

import pyarrow as pa

from pipeline.errors import GRPOError
from pipeline.data.prompts import derive_seed, iteration_prompt_ids, load_dataset, make_prompts, prompt_made_up, raw_to_json
from pipeline.models.engines import engine_dtype, make_engine, model_context
from pipeline.models.stop_tokens import stop_token_ids
from pipeline.run.template_date import dated
from pipeline.run.parts import Shard, n_parts, part_groups, run_parts
from pipeline.rewards.calls import TrainerState, trainer_state_at
from pipeline.run.run import Run
from pipeline.run import inflight
from pipeline.store import policy_rel
from pipeline.schedule import iteration_plan
from schemas.artifacts import ROLLOUT


def engine_max_len(cfg, context: int) -> int:
    """One engine length for rollout and eval, so a warm engine serves both."""
    return cfg.rollout.max_model_len or min(context, 4096)


class RolloutInputs:
    """Iteration k's prompts, rendered and tokenized, how they split into parts, and the
    behaviour policy b(k) that samples them."""

    def __init__(self, run: Run, k: int):
        from pipeline.models.tokenizer_cache import tokenizer_of

        cfg = run.cfg
        self.run, self.k = run, k
        self.iteration = iteration_plan(cfg, k)
        self.policy_iter = b = self.iteration.behaviour
        self.policy_dir = run.policy_dir(b, needed_by=f"rollout of iteration {k}", weights=False)  # the engine's load waits for them
        self.tokenizer = dated(tokenizer_of(run.plain_dir(b)), cfg.data.template_date)
        self.stop_ids = stop_token_ids(run.plain_dir(b), self.tokenizer)  # what the engine stops on, as it derives them
        df = load_dataset(cfg.data.train, cfg.data.prompt_column, cfg.data.prompt_template, cfg.rollout.environment is not None)
        self.n_rows = df.height
        ids = iteration_prompt_ids(df.height, cfg.rollout.prompts_per_iter, cfg.seed, k)
        self.context = model_context(run.plain_dir(b))
        self.prompts = make_prompts(df, ids, self.tokenizer, cfg.data, cfg.data.train, self.context - cfg.rollout.max_new_tokens)
        self.num_parts = n_parts(len(self.prompts), cfg.rollout.groups_per_part)
        self.max_model_len = engine_max_len(cfg, self.context)
        self.episodes = None
        if cfg.rollout.agentic:  # multi-turn episodes: tools, environments (pipeline.agents)
            from pipeline.agents.episode import EpisodeRunner
            from pipeline.agents.setup import load_agents

            from pipeline.rewards.contract import run_code

            with run_code(run):  # the tools and environments the run carries (pipeline/store/code.py)
                agents = load_agents(cfg.rollout, self.tokenizer, run.plain_dir(b), cfg.model)  # b(k): policy k may not exist yet
                if cfg.rollout.agent is not None:  # the agent's scripts: run from the run's copies
                    from pipeline.agents.endpoint.vf_run import run_argv
                    from pipeline.rewards.loading import copy_of

                    agent_command = run_argv(cfg.rollout.agent, copy_of)
            room = self.max_model_len - cfg.rollout.episode_tokens()
            if room < 1:
                raise GRPOError(f"rollout.max_episode_tokens ({cfg.rollout.episode_tokens()}) leaves no room for a prompt "
                                f"in the engine's {self.max_model_len} tokens")
            if cfg.rollout.agent is not None:  # an agent program behind grpo's endpoint (pipeline.agents.endpoint)
                from pipeline.agents.endpoint.runner import EndpointRunner as EpisodeRunner
            self.episodes = EpisodeRunner(agents, self.tokenizer, cfg.rollout, cfg.data, room,
                                          prompt_given=not prompt_made_up(cfg.data.train, cfg.data, True))
            if cfg.rollout.agent is not None:
                self.episodes.command = agent_command

    @cached_property
    def policy_hash(self) -> str:
        """Policy b(k)'s hash: asked once a part is stamped (`iterate` may still be recording it)."""
        return self.run.policy_hash(self.policy_iter)

    def inputs(self) -> dict:
        """What the parts are sampled from, stamped into each: the policy, the data, and the ids
        that end a completion (read from the policy's files by this code: recorded, so that a change
        in how they are derived rewrites the parts of an unfinished rollout instead of mixing them);
        for tool episodes, the chat template that rendered them (its name and sha256: the model's
        own, or the training template swapped in, pipeline/agents/templates.py) and the tool format."""
        out = {"policy": {"path": policy_rel(self.policy_iter), "policy_hash": self.policy_hash}, "data": self.run.cfg.data.train,
               "stop_token_ids": self.stop_ids}
        if self.episodes is not None:  # which chat template rendered the episodes: the model's own or a training one
            fmt = self.episodes.a.format
            out["chat_template"] = {**fmt.template.record(), "tool_format": fmt.kind, "parser": fmt.parser}
            if self.run.cfg.rollout.agent is not None:  # the agent's command and its files' sha256
                out["agent"] = self.episodes.stamp()
        return out

    def trainer_state(self) -> TrainerState:
        """What TRL reward functions get as `trainer_state` when these completions are scored."""
        return trainer_state_at(self.run.cfg, self.k, self.n_rows)

    def manifest_extra(self, stats: dict) -> dict:
        """What the rollout manifest records beside the parts (the local and the Ray executor's alike)."""
        cfg = self.run.cfg
        return {"policy_hash": self.policy_hash, "engine": cfg.rollout.engine, "stats": stats,
                "engine_dtype": engine_dtype(cfg.rollout.dtype, cfg.train.precision),
                "trainer_state": self.trainer_state().to_dict(), "staleness": self.iteration.staleness}

    def group_seed(self, prompt_id: int) -> int:
        return derive_seed(self.run.cfg.seed, self.k, prompt_id)


def engine_settings(run: Run, k: int, shared: bool = False):
    """How a vLLM engine for policy k uses this machine (pipeline.models.device_budget), None for
    rollout.engine hf. `shared`: the trainer shares the GPU (`iterate`). Raises the one-line
    error of a GPU split that cannot fit: called before any engine loads."""
    cfg = run.cfg
    if cfg.rollout.engine != "vllm":
        return None
    from pipeline.models.device_budget import engine_settings_for, this_device

    plain = run.plain_dir(k)
    return engine_settings_for(cfg.rollout, plain, engine_max_len(cfg, model_context(plain)), cfg.train.precision, this_device(),
                       shared_with=run.policy if shared else None)


def policy_engine(run: Run, k: int, engine=None, settings=None, weights: list | None = None, where: str | None = None):
    """An engine sampling from policy k (the policy's own index: a rollout passes its behaviour
    policy b(k), eval the policy it evaluates): started (with `settings`, its `device_budget.EngineSettings`), or given policy k in place,
    from its stored directory or from `weights` equal to it (rollout.weight_sync memory). A
    LoRA policy is sent as merged weights, or (rollout.lora_mode vllm_lora) as an adapter over the base.
    After every load the engine proves it holds policy k (`sampler_proof.check_engine`: a one-line
    error naming `where`, e.g. "rollout iteration 3", and the gap, when it does not)."""
    from pipeline.run.sampler_proof import check_engine

    cfg, policy = run.cfg, run.policy
    built = policy.engine_tensors(run, k)  # a merged LoRA policy: built in memory, never written
    weights_given = built or weights
    weights, adapter = policy.engine_weights(run, k)
    if not weights_given:  # the engine reads policy k's files: a write of them in flight is settled
        run.policy_dir(k)
    loaded = engine is None or engine.model_dir != weights or engine.adapter != adapter
    if engine is None:  # weights built in memory: a new engine starts from policy 0's files, then takes them
        max_len = engine_max_len(cfg, model_context(run.plain_dir(k)))
        engine = make_engine(run.policy_dir(0) if built else weights, cfg.rollout, max_len, cfg.seed, max_lora_rank=policy.engine_lora_rank(),
                             precision=cfg.train.precision, settings=settings, files_ready=inflight.wait_dir)
    if engine.model_dir != weights:
        engine.load(weights, weights=None if adapter is not None else weights_given)
    engine.adapter = adapter
    if loaded:
        check_engine(run, k, engine, policy, where or f"engine for policy {k}")
    return engine


def generate_part(inputs: RolloutInputs, engine, part: int) -> pa.Table:
    cfg = inputs.run.cfg.rollout
    groups = list(part_groups(part, len(inputs.prompts), cfg.groups_per_part))
    prompts = [inputs.prompts[g] for g in groups]
    if inputs.episodes is not None:
        return episode_part(inputs, engine, groups, prompts)
    samples = engine.generate([p.ids for p in prompts], [inputs.group_seed(p.prompt_id) for p in prompts], cfg.num_generations)
    rows = []
    for g, p, group in zip(groups, prompts, samples):
        for j, s in enumerate(group):
            rows.append(
                {
                    "prompt_id": p.prompt_id,
                    "sample_idx": j,
                    "group_idx": g,
                    "prompt": p.text,
                    "prompt_raw": raw_to_json(p.raw),
                    "prompt_ids": p.ids,
                    "completion": s.text,
                    "completion_ids": s.token_ids,
                    "sampler_logprobs": s.logprobs,
                    "finish_reason": s.finish_reason,
                    "truncated": s.finish_reason == "length",
                    "completion_length": len(s.token_ids),
                    "policy_hash": inputs.policy_hash,
                    "completion_mask": None,  # every token sampled
                    "episode": None,
                    **p.columns,
                }
            )
    return pa.Table.from_pylist(rows)


def episode_part(inputs: RolloutInputs, engine, groups: list[int], prompts: list) -> pa.Table:
    """G multi-turn episodes per prompt, one row each (pipeline.agents.episode)."""
    runner, G = inputs.episodes, inputs.run.cfg.rollout.num_generations
    where = inputs.run.cfg.data.train
    episodes = [runner.start(p, g, j, inputs.group_seed(p.prompt_id), f"{where} row {p.prompt_id}")
                for g, p in zip(groups, prompts) for j in range(G)]
    runner.run(engine, episodes)
    if episodes and all(getattr(e, "ending", None) == "agent_crashed" for e in episodes):  # endpoint agents (runner.py)
        e = episodes[0]  # no turn to train on: a broken agent program, not a rollout (nothing written)
        raise GRPOError(f"rollout.agent: every episode of the part with {where} rows {sorted({p.prompt_id for p in prompts})} "
                        f"ended agent_crashed; the first's agent ({where} row {e.prompt.prompt_id}) {e.detail}: {e.tail}")
    return pa.Table.from_pylist([runner.row(e, inputs.policy_hash) for e in episodes])


def run_rollout(run: Run, k: int, shard: Shard = Shard(), engine=None) -> dict | None:
    """Write this shard's rollout parts of iteration k; returns the manifest once all are in.

    `engine` lets `iterate` pass a warm engine already holding policy b(k).
    """
    if run.done(k, "rollout"):
        return run.manifest(k, "rollout")
    inputs = RolloutInputs(run, k)
    settings = engine_settings(run, inputs.policy_iter) if engine is None else None  # a split that cannot fit fails before any part
    stats = {"engine_start_s": 0.0, "tokens": 0, "generate_s": 0.0}
    owned = {"engine": engine}

    def make_part(part: int) -> pa.Table:
        if owned["engine"] is None:
            t = time.time()
            owned["engine"] = policy_engine(run, inputs.policy_iter, settings=settings, where=f"rollout iteration {k}")
            stats["engine_start_s"] += time.time() - t
        t = time.time()
        table = generate_part(inputs, owned["engine"], part)
        stats["generate_s"] += time.time() - t
        stats["tokens"] += int(sum(table.column("completion_length").to_pylist()))
        if inputs.episodes is not None:
            stats.update(tool_calls=inputs.episodes.tool_calls, tool_s=round(inputs.episodes.tool_s, 6))
        return table

    try:
        return run_parts(
            run, k, "rollout", ROLLOUT, inputs.num_parts, shard, inputs.inputs, make_part,
            manifest_extra=lambda: inputs.manifest_extra(stats),
        )
    finally:
        if engine is None and owned["engine"] is not None:
            owned["engine"].close()
