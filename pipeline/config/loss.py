"""The loss section of the config, apart from the torch math in pipeline/objective/loss.py, so that reading a
run's config (status, inspect, audit, --help) does not import torch."""

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section


class RolloutCorrection(Section):
    """Importance weight w = pi_old / pi_sampler on the policy term, for the gap between the engine
    that sampled (vLLM, or an older policy when iterations run ahead) and the trainer's old policy;
    TRL's vllm_importance_sampling_* options. Formulas in docs/loss.md."""

    mode: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    """none, or a weight per token / one per completion (`sequence_log_ratio` of its model tokens'
    log-ratios) that is truncated (w = min(w, cap)) or masked (w = 0 outside [lower, cap]).
    Default sequence_mask, as TRL 1.16. Runs made before this option keep none."""
    cap: float = Field(3.0, gt=1.0)
    """Upper bound on w (> 1): truncate modes clip w to it, mask modes zero a weight above it (TRL's clip_max)."""
    lower: float | None = Field(None, ge=0.0, lt=1.0)
    """Lower bound on w (< 1): mask modes zero a weight below it, truncate modes raise w to it (TRL's clip_min); None: no bound."""
    sequence_log_ratio: Literal["sum", "mean"] = "sum"
    """sequence_* modes: sum (the completion's likelihood ratio, as TRL 1.16) or mean (its geometric
    mean per token, TRL PR #5815's proposal: no length dependence, but not an importance weight)."""


NEUTRAL_ROLLOUT_CORRECTION = RolloutCorrection(mode="none").model_dump(mode="json")
"""What runs did before `loss.rollout_correction` existed: no correction."""


class LossConfig(Section):
    """Which surrogate loss the update optimises, and its coefficients."""

    type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "reinforce"] = "grpo"
    """Loss aggregation: grpo (per-sequence mean), bnpo (per-token over each micro-batch), dr_grpo (fixed length normaliser), dapo (per-token over the mini-batch), reinforce (plain policy gradient)."""
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower clip range: the ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """Upper clip range: the ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher sets it > clip_eps_low)."""
    delta: float | None = Field(None, gt=1.0)
    """Two-sided clipping: cap the unclipped ratio at delta (> 1) in the first term; None disables."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL(policy || reference) penalty in the loss (TRL's beta). 0 skips the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - log r - 1 with r = ref/policy."""
    importance_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or one per sequence from the mean log-ratio (GSPO)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight: the loss subtracts entropy_coef * mean token entropy."""
    rollout_correction: RolloutCorrection = RolloutCorrection()
    """Sampler-mismatch correction: importance weight old / sampler on the policy term (TRL's vllm_importance_sampling_*)."""
