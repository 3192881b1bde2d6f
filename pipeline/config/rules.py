"""Every rule of the config that needs more than one key, written once: `refusal(cfg)` is the
validator of the whole tree (`Config._cross_field`), so `grpo init`, a stored config.yaml and
every process that reads a run refuse the same configs with the same line. A rule inside one
section (a range, a type) stays on that section's field."""

from __future__ import annotations

import re

from pipeline.config.eval import RESERVED, TAKEN


def refusal(c) -> str | None:
    """Why the config `c` (a pipeline.config.Config) cannot run (one line naming the keys), or None;
    the first rule broken wins."""
    t, r = c.train, c.rollout
    if t.mini_batch_size % t.grad_accum:
        return f"train.mini_batch_size ({t.mini_batch_size}) must be divisible by train.grad_accum ({t.grad_accum})"
    if not c.rewards and r.environment is None and r.agent is None:
        return "rewards: at least one reward function (or a rollout.environment class with get_reward, or rollout.agent)"
    names = [w.column for w in c.rewards]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        return f"rewards: duplicate reward name {dup[0]!r}; give each a distinct `name`"
    if c.data.eval is not None and (why := eval_refusal(c)):
        return why
    if t.lora is not None and c.ref_model is not None:
        return "train.lora: the reference is the base with the adapter off; leave ref_model unset"
    if r.lora_mode == "vllm_lora" and (t.lora is None or r.engine != "vllm"):
        return "rollout.lora_mode vllm_lora needs train.lora and rollout.engine vllm"
    if r.weight_sync == "memory" and t.lora is not None:
        return "rollout.weight_sync memory hands over full weights; with train.lora use weight_sync disk"
    if c.loss.type == "reinforce" and t.epochs > 1:
        return "loss.type reinforce has no importance ratio; use train.epochs 1"
    if why := truncated_sampling(c):
        return why
    if c.cluster.executor == "ray" and t.max_staleness:
        return "cluster.executor ray runs on-policy iterations; with train.max_staleness use the local executor"
    if r.agentic and not c.data.chat_template:
        return "rollout.tools / rollout.environment / rollout.agent need chat prompts; set data.chat_template: true"
    return uncorrectable(c)


def eval_refusal(c) -> str | None:
    """Why the eval settings cannot run (one line naming the key), or None."""
    e = c.eval
    if e.samples > 1 and e.greedy:
        return f"eval.samples {e.samples}: greedy decoding gives k copies of one completion; set eval.greedy: false"
    if too := [k for k in e.pass_k if not 1 <= k <= e.samples]:
        return f"eval.pass_k {too[0]}: each k must be between 1 and eval.samples ({e.samples})"
    if isinstance(c.data.eval, dict):
        if not c.data.eval:
            return "data.eval: an empty mapping; name at least one eval set (or leave data.eval unset)"
        for name in c.data.eval:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in RESERVED or TAKEN.fullmatch(name):
                return (f"data.eval.{name}: an eval set's name is a metric path segment: letters, digits, _ . - "
                        f"and none of {', '.join(sorted(RESERVED))}, a figure's name (pass_at_4, accuracy_lo) or dots only")
    if e.every > 0:
        for s in c.eval_sets():
            if why := unknown_eval_reward(c, s):
                return why
    return None


def unknown_eval_reward(c, s) -> str | None:
    """Why eval set `s` (one of `c.eval_sets()`) cannot count accuracy: its reward names none of the run's; or
    None. The config asks only when eval.every > 0; `grpo eval` asks before it scores."""
    names = [w.column for w in c.rewards]
    if s.reward in names:
        return None
    key = "eval.reward" if s.name is None or s.reward == c.eval.reward else f"data.eval.{s.name}.reward"
    return f"{key} {s.reward!r}: no reward named so (rewards: {', '.join(names)})"


def truncated_sampling(c) -> str | None:
    """Why the rollout correction cannot run with these sampling settings, or None. The engine reports
    logprobs of the distribution it sampled (vLLM processed_logprobs: truncated by top_p, top_k,
    min_p and renormalised), the trainer of the whole one: log w would then carry log(kept mass)
    on every token, a bias and not the engines' gap (TRL issue #6789)."""
    mode, r = c.loss.rollout_correction.mode, c.rollout
    if mode == "none" or (r.top_p == 1.0 and r.top_k == 0 and r.min_p == 0.0):
        return None
    return (f"loss.rollout_correction.mode {mode} needs untruncated sampling (rollout.top_p 1, top_k 0, min_p 0; "
            f"got {r.top_p}, {r.top_k}, {r.min_p}): the sampler's logprobs are then renormalised over the kept tokens "
            "and the weight would measure the truncation; set loss.rollout_correction.mode none")


def uncorrectable(c) -> str | None:
    """Why stale samples (train.max_staleness) could not be corrected under this config, or None."""
    s = c.train.max_staleness
    if not s:
        return None
    if c.loss.type == "reinforce":
        return (f"train.max_staleness {s}: loss.type reinforce has no importance ratio to correct samples "
                "from an older policy with; use a clipped loss (grpo, bnpo, dr_grpo, dapo) or max_staleness 0")
    # the weight exp(old_logprobs - sampler_logprobs) is what makes stale samples usable
    if c.loss.rollout_correction.mode == "none":
        return (f"train.max_staleness {s}: needs loss.rollout_correction (the weight exp(old - sampler) "
                "that corrects for the older behaviour policy); it is off")
    return None
