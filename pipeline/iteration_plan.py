"""What iteration k of a run does, decided once from its config (`iteration_plan`): which policy
samples it, where its old logprobs come from, whether a reference pass runs.

Rollout, logprobs, update, eval, replay, the logprob models and both `iterate` loops (in one
process, or with the sampler in a second one) ask this object instead of deciding again, so
they cannot disagree; nothing here depends on timing, so every process that plans iteration k
plans the same thing, and `grpo init` prints the same plan (pipeline/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config


@dataclass(frozen=True)
class IterationPlan:
    """Iteration k, decided once from the config: which policy samples it, where its old
    logprobs come from, whether a reference pass runs. Rollout, logprobs, update, eval, replay and
    both `iterate` loops ask this object instead of deciding again; nothing here depends on timing,
    so every process that plans iteration k plans the same thing."""

    k: int
    behaviour: int
    """b(k): the policy whose engine samples iteration k (k, or k - train.max_staleness; pipeline/staleness.py)."""
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


def iteration_plan(cfg: Config, k: int) -> IterationPlan:
    """The plan of iteration k of a run with config `cfg`. At iteration 0 without a ref_model the
    old policy is the reference (same weights, same arithmetic): one pass. When every epoch makes
    one optimizer step (`Config.old_from_update`) the update's first-epoch forward gives the old
    logprobs, so the logprobs stage makes no old pass, unless it makes that very pass for the
    reference anyway."""
    from pipeline.staleness import behaviour, staleness

    ref_is_old = cfg.uses_ref and k == 0 and cfg.ref_model is None
    return IterationPlan(k=k, behaviour=behaviour(cfg, k), staleness=staleness(cfg, k), ref_is_old=ref_is_old,
                         old_from_update=cfg.old_from_update and not ref_is_old, reference=cfg.uses_ref)
