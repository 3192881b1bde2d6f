"""The loss section of the config, apart from the torch math in pipeline/grpo.py, so that reading a
run's config (status, inspect, audit, --help) does not import torch."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LossConfig(BaseModel):
    """Which surrogate loss the update optimises, and its coefficients."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "reinforce"] = "grpo"
    """Loss aggregation: grpo (per-sequence mean), bnpo (per-token over the mini-batch), dr_grpo (fixed length normaliser), dapo (per-token over the generation batch), reinforce (plain policy gradient)."""
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

    @property
    def kind(self):
        """The `pipeline.grpo.LossType` that owns this type's arithmetic (torch loads here)."""
        from pipeline.grpo import LOSS_TYPES

        return LOSS_TYPES[self.type]
