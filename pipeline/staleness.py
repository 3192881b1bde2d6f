"""Bounded staleness (`train.max_staleness: s`): which policy samples which iteration.

Iteration k's completions are sampled from its behaviour policy b(k) = max(0, k - s), while its
logprobs and update start from policy k as always: old_logprobs are policy k's, the rollout's
sampler_logprobs are b(k)'s, so the update's rollout correction exp(old - sampler) weighs each
token by how much more (or less) likely policy k makes it than the policy that sampled it,
covering the sampler's numerics and the s updates in between alike.

The schedule depends only on the config, never on timing: `grpo rollout RUN --iter k` samples
from policy b(k) whoever runs it and whenever, so `iterate` may sample iteration k+1 (policy
k+1-s exists as soon as update k-s is done) while iteration k's update runs in this process
(pipeline/overlap.py), and the separate stage commands, a rerun or a resume after SIGKILL all
write the same bytes. s = 0 is the strictly on-policy schedule of runs made before the option.

The rollout manifest names b(k) as `inputs.policy` (path and hash, as every rollout does) and
records `staleness` = k - b(k) when s > 0; `grpo audit` checks that link here.
"""

from __future__ import annotations


def behaviour(cfg, k: int) -> int:
    """b(k): the policy iteration k's completions are sampled from."""
    return max(0, k - cfg.train.max_staleness)


def staleness(cfg, k: int) -> int | None:
    """What iteration k's rollout manifest records: k - b(k), or None on the on-policy schedule
    (whose manifests stay byte-identical to those of runs made before the option)."""
    return k - behaviour(cfg, k) if cfg.train.max_staleness else None


def uncorrectable(cfg) -> str | None:
    """Why stale samples could not be corrected under this config (the validator's one line), or None."""
    s = cfg.train.max_staleness
    if not s:
        return None
    if cfg.loss.type == "reinforce":
        return (f"train.max_staleness {s}: loss.type reinforce has no importance ratio to correct samples "
                "from an older policy with; use a clipped loss (grpo, bnpo, dr_grpo, dapo) or max_staleness 0")
    # the weight exp(old_logprobs - sampler_logprobs) is what makes stale samples usable
    if cfg.loss.rollout_correction.mode == "none":
        return (f"train.max_staleness {s}: needs loss.rollout_correction (the weight exp(old - sampler) "
                "that corrects for the older behaviour policy); it is off")
    return None


def check_sampled_from(auditor, k: int, m, mrel: str, stage: str) -> None:
    """audit: a rollout (eval) of iteration k names its behaviour policy b(k) (policy k) by the
    hash that policy's manifest records, and a rollout records its staleness k - b(k)."""
    from pipeline.store import policy_rel  # not at the top: the config imports this module

    cfg = auditor.run.cfg
    b = behaviour(cfg, k) if stage == "rollout" and m.replayed_from is None else k  # a replay's iteration 0 is policy 0's
    policy = m.inputs.get("policy") or {}
    want = auditor.committed_policy(b, mrel)
    if want is not None and (policy.get("policy_hash") != want or (m.policy_hash or want) != want):
        auditor.audit.problem(mrel, f"inputs.policy.policy_hash {(policy.get('policy_hash') or 'none')[:12]} "
                                    f"does not match {policy_rel(b)} ({want[:12]})")
    if stage == "rollout" and m.replayed_from is None and m.staleness != staleness(cfg, k):
        auditor.audit.problem(mrel, f"staleness {m.staleness!r}, expected {staleness(cfg, k)!r} "
                                    f"(train.max_staleness {cfg.train.max_staleness}: sampled from {policy_rel(b)})")
