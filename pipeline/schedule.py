"""The run's schedule, decided once from its config and never from timing: which policy samples
iteration k (`behaviour`, b(k)), which policies are evaluated (`eval_due`), where iteration k's
old logprobs come from and whether a reference pass runs (`iteration_plan`), and how many
optimizer steps an iteration makes (`steps_per_iter`). Rollout, logprobs, update, eval, replay,
retention, the logprob models and the loop ask here instead of deciding again, so they cannot
disagree; every process that plans iteration k plans the same thing, and `grpo init` prints
the same plan (pipeline/preview.py).

Bounded staleness (`train.max_staleness: s`): iteration k's completions are sampled from its
behaviour policy b(k) = max(0, k - s), while its logprobs and update start from policy k as
always: old_logprobs are policy k's, the rollout's sampler_logprobs are b(k)'s, so the update's
rollout correction exp(old - sampler) weighs each token by how much more (or less) likely policy
k makes it than the policy that sampled it, covering the sampler's numerics and the s updates in
between alike. `grpo rollout RUN --iter k` samples from policy b(k) whoever runs it and whenever,
so `iterate` may sample iteration k+1 while iteration k's update runs (pipeline/loop/overlap.py),
and the separate stage commands, a rerun or a resume after SIGKILL all write the same bytes.
s = 0 is the strictly on-policy schedule of runs made before the option. The rollout manifest
names b(k) as `inputs.policy` and records `staleness` = k - b(k) when s > 0; `grpo audit`
checks that link (pipeline/report/audit_parts.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config


def behaviour(cfg: Config, k: int) -> int:
    """b(k): the policy iteration k's completions are sampled from."""
    return max(0, k - cfg.train.max_staleness)


def staleness(cfg: Config, k: int) -> int | None:
    """What iteration k's rollout manifest records: k - b(k), or None on the on-policy schedule
    (whose manifests stay byte-identical to those of runs made before the option)."""
    return k - behaviour(cfg, k) if cfg.train.max_staleness else None


def eval_due(cfg: Config, k: int) -> bool:
    """Whether policy k is evaluated: policy 0 and every eval.every-th after it, when data.eval is set."""
    every = cfg.eval.every
    return bool(every and cfg.data.eval and k % every == 0)


def steps_per_iter(cfg: Config) -> int:
    """Optimizer steps of one iteration: every epoch walks the completions in mini-batches."""
    n = cfg.rollout.prompts_per_iter * cfg.rollout.num_generations
    return cfg.train.epochs * math.ceil(n / cfg.train.mini_batch_size)


@dataclass(frozen=True)
class IterationPlan:
    """Iteration k, decided once from the config: which policy samples it, where its old
    logprobs come from, whether a reference pass runs. Rollout, logprobs, update, eval, replay and
    the loop ask this object instead of deciding again; nothing here depends on timing,
    so every process that plans iteration k plans the same thing."""

    k: int
    behaviour: int
    """b(k): the policy whose engine samples iteration k (k, or k - train.max_staleness; pipeline/schedule.py)."""
    staleness: int | None
    """k - b(k) as the rollout manifest records it; None on the on-policy schedule."""
    ref_is_old: bool
    """The reference is the old policy itself (iteration 0 without a ref_model): one pass gives both."""
    old_from_update: bool
    """The old logprobs are the update's own first-epoch forward (one optimizer step per epoch): no old pass."""
    reference: bool
    """A reference pass runs (KL in the loss or in the reward)."""

    @property
    def old_pass(self) -> bool:
        """Whether the logprobs stage runs the old policy (for the old logprobs, or as the reference)."""
        return not self.old_from_update or self.ref_is_old

    @property
    def ref_pass(self) -> bool:
        """Whether the logprobs stage needs a reference model besides the old one."""
        return self.reference and not self.ref_is_old


def uses_ref(cfg: Config) -> bool:
    """Whether a reference pass runs (KL in the loss or in the reward)."""
    return cfg.loss.kl_coef > 0 or cfg.advantages.kl_in_reward.coef > 0


def old_from_update(cfg: Config) -> bool:
    """Whether the update takes the old logprobs from its own first-epoch forward (`train.old_logprobs` auto, one
    optimizer step per epoch, no dropout to make that forward differ, no KL in the reward that needs them before)."""
    t = cfg.train
    one_step = cfg.rollout.prompts_per_iter * cfg.rollout.num_generations <= t.mini_batch_size  # per epoch
    return t.old_logprobs == "auto" and one_step and not cfg.dropout and cfg.advantages.kl_in_reward.coef == 0


def iteration_plan(cfg: Config, k: int) -> IterationPlan:
    """The plan of iteration k of a run with config `cfg`. At iteration 0 without a ref_model the
    old policy is the reference (same weights, same arithmetic): one pass. When every epoch makes
    one optimizer step (`old_from_update`) the update's first-epoch forward gives the old
    logprobs, so the logprobs stage makes no old pass, unless it makes that very pass for the
    reference anyway."""
    ref_is_old = uses_ref(cfg) and k == 0 and cfg.ref_model is None
    return IterationPlan(k=k, behaviour=behaviour(cfg, k), staleness=staleness(cfg, k), ref_is_old=ref_is_old,
                         old_from_update=old_from_update(cfg) and not ref_is_old, reference=uses_ref(cfg))
