"""The sampler-mismatch weight of `loss.rollout_correction` as a pure torch function (no I/O).

The engine that sampled a completion (vLLM, or an older policy when iterations run ahead of the
update) is not exactly the trainer's old policy; w = pi_old / pi_sampler reweighs the policy
term towards what the old policy would have sampled, as TRL 1.16's vllm_importance_sampling_*
does. Formulas and the choices made (sum over the sequence, masked weights kept in the
denominator) in docs/loss.md; golden values in tests/test_rollout_correction.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pipeline.config.loss import RolloutCorrection

if TYPE_CHECKING:
    import polars as pl
    import torch

EXTREMES = {"rollout_correction/ratio_min": min, "rollout_correction/ratio_max": max}
"""Metrics that combine over micro-batches, pieces and ranks by min / max, not by a weighted mean."""


def correction_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrection) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached weight [B, T] on each token's policy loss, and its metrics.

    old_logprobs / sampler_logprobs [B, T]; mask [B, T] is 1 on the tokens the model sampled
    (positions where it is 0 may hold anything: padding, a tool result's 0.0, NaN). token_*:
    log w = old - sampler per token; sequence_*: one log w per completion, the sum (or mean) of
    its model tokens' log-ratios. truncate: w = clamp(w, lower, cap); mask: w = 0 outside
    [lower, cap]. Masked-out positions get w = 0.
    """
    import torch

    active = mask.bool()  # [B, T]
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    m = active.to(dtype)  # [B, T]
    diff = (old_logprobs.detach().to(dtype) - sampler_logprobs.detach().to(dtype)).masked_fill(~active, 0.0)  # [B, T]
    if cfg.mode.startswith("sequence"):
        seq = diff.sum(dim=1, keepdim=True)  # [B, 1] log of the completion's likelihood ratio
        if cfg.sequence_log_ratio == "mean":
            seq = seq / m.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1] per model token
        log_w = seq.expand_as(diff)  # [B, T]
    else:
        log_w = diff  # [B, T]
    w = torch.exp(log_w)  # [B, T], may be 0 or inf for a long sequence: both are handled below
    lower = cfg.lower if cfg.lower is not None else 0.0
    cut = ((w > cfg.cap) | (w < lower)) & active  # [B, T] outside the trusted range
    if cfg.mode.endswith("truncate"):
        w = w.clamp(min=lower, max=cfg.cap)
    else:
        w = w.masked_fill(cut, 0.0)
    w = w.masked_fill(~active, 0.0)  # [B, T]

    with torch.no_grad():
        n = m.sum()
        kept = w[active]  # [N]
        metrics = {
            "rollout_correction/ratio_mean": float(kept.sum() / n.clamp(min=1)),
            "rollout_correction/ratio_min": float(kept.min()) if kept.numel() else float("nan"),
            "rollout_correction/ratio_max": float(kept.max()) if kept.numel() else float("nan"),
            "rollout_correction/clipped_frac": float(cut.to(dtype).sum() / n.clamp(min=1)),
        }
    return w, metrics


def combine(acc: dict[str, float], key: str, value: float, weight: float) -> None:
    """Add one piece's metric to `acc`: a weighted sum, or min / max for the `EXTREMES` (a piece
    without tokens, NaN there, does not count)."""
    pick = EXTREMES.get(key)
    if pick is None:
        acc[key] = acc.get(key, 0.0) + value * weight
    elif math.isnan(value):
        acc.setdefault(key, float("nan"))
    else:
        acc[key] = value if math.isnan(acc.get(key, float("nan"))) else pick(acc[key], value)


QUANTILES = (0.05, 0.5, 0.95)
"""The quantiles of the per-completion log-weight an iteration reports."""


def iteration_stats(rows: "pl.DataFrame", cfg: RolloutCorrection) -> dict[str, float]:
    """What the correction does to one iteration's completions, from its stored logprobs: `rows`
    has old_logprobs, sampler_logprobs and completion_mask (null: every token the model's) per
    completion. w = old / sampler is fixed for the iteration (both detached), so these are exactly
    the weights the update applies.

    rollout_correction/log_ratio_p05, _p50, _p95: quantiles of each completion's log W (the sum of
    its model tokens' old - sampler, or their mean with `sequence_log_ratio: mean`), whatever the mode;
    rollout_correction/clipped_seq_frac: the share of completions whose weight (any of their tokens'
    in the token modes) is truncated or masked, NaN with mode none."""
    logs, cut = [], []
    lower = math.log(cfg.lower) if cfg.lower else -math.inf
    upper = math.log(cfg.cap)
    for old, sampler, mask in zip(rows["old_logprobs"].to_list(), rows["sampler_logprobs"].to_list(),
                                  rows["completion_mask"].to_list()):
        if old is None or sampler is None:
            continue
        d = np.asarray(old, np.float64) - np.asarray(sampler, np.float64)  # [T]
        if mask is not None:
            d = d[np.asarray(mask, bool)]
        if not len(d):
            continue  # no model token: no weight
        seq = float(d.sum() / (len(d) if cfg.sequence_log_ratio == "mean" else 1))
        logs.append(seq)
        x = d if cfg.mode.startswith("token") else np.array([seq])
        cut.append(bool(((x > upper) | (x < lower)).any()))
    if not logs:
        return {}
    q = np.quantile(np.asarray(logs), QUANTILES)
    out = {f"rollout_correction/log_ratio_p{round(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}
    out["rollout_correction/clipped_seq_frac"] = float("nan") if cfg.mode == "none" else float(np.mean(cut))
    return out
