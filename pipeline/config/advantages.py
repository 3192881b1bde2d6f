"""The `advantages:` section: how rewards become group-relative advantages (the arithmetic is
pipeline/objective/advantages.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section


class KLRewardConfig(Section):
    """KL placed in the reward (toxicity-workflow style) instead of the loss."""

    coef: float = Field(0.0, ge=0.0)
    """Initial KL coefficient subtracted from each completion's reward (sum over tokens of k1)."""
    target: float | None = Field(None, gt=0.0)
    """Adaptive controller target KL per completion; None keeps coef fixed."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon (Ziegler et al.), in completions."""


class AdvantageConfig(Section):
    """Group-relative normalisation of rewards into advantages (stage 2)."""

    scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group's std, the whole batch's std, or not at all (Dr. GRPO)."""
    std: Literal["sample", "population"] = "sample"
    """Std convention: sample (Bessel, torch.std and TRL) or population."""
    eps: float = Field(1e-4, ge=0.0)
    """Added to the std before dividing."""
    std_floor: float | None = Field(None, gt=0.0)
    """Clamp the std below at this floor instead of adding eps (seed notes: 0.1)."""
    batch_renorm: bool = False
    """Re-normalise the advantages over the whole batch after the group step."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards have no spread from training (recorded in the score part, not deleted)."""
    kl_in_reward: KLRewardConfig = KLRewardConfig()
    """Optional KL penalty folded into the reward before normalisation (applied at update time)."""
