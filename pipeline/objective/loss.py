"""The GRPO objective as small pure torch functions (no I/O), top to bottom: how each loss type
reduces its per-token losses and how micro-batches, pieces and ranks add up under it (`LossType`,
one subclass per `loss.type`; `loss_type(cfg.loss)` picks one, and the trainer and `policy_loss`
ask it and never name a type), the KL estimators, and `policy_loss` for one micro-batch.

The rewards' side (`combine_rewards`, `group_advantages`, `group_stats`) is NumPy, in
pipeline/objective/advantages.py, so that the score stage does not load torch. Here: the KL estimators,
`kl_penalised_rewards` (its controllers in pipeline/objective/kl.py), and the update's
`policy_loss` per micro-batch (its sampler-mismatch weight in pipeline/objective/correction.py).
The formulas, one per loss type, are in docs/loss.md; every function here is checked against
hand-derived numbers and a naive loop in tests/test_grpo.py:

    .venv/bin/python -m pytest tests/test_grpo.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from pipeline.objective.correction import correction_weights

if TYPE_CHECKING:
    from pipeline.config.loss import LossConfig


# --------------------------------------------------------------------------- loss types

class LossType:
    """How one loss type reduces its per-token losses, and how micro-batches and ranks add up.

    The default is grpo's: each sequence weighs the same, whatever its length. The trainer asks
    these objects and never names a type, so a new type is one subclass here."""

    name = "grpo"
    clipped = True
    """Whether the surrogate uses the clipped importance ratio (reinforce: plain policy gradient)."""
    sums_micro_batches = False
    """True when each micro-batch's loss is already a share of the whole mini-batch's (dapo),
    so micro-batch losses add up; otherwise each is weighed by its share (`micro_batch_share`)."""

    def reduce(self, per_token: torch.Tensor, m: torch.Tensor, max_completion_length, num_items) -> torch.Tensor:
        """Reduce a per-token loss [B, T] over active tokens (m = float mask) to a scalar, as TRL defines it."""
        token_sum = (per_token * m).sum(dim=1)  # [B]
        return (token_sum / m.sum(dim=1).clamp(min=1)).mean()

    def check(self, max_completion_length, num_items) -> None:
        """Raise ValueError when an argument this type needs is missing."""

    def micro_batch_share(self, share_rows: float, share_tokens: float, n_micro: int) -> float:
        """Factor on a micro-batch's loss so the accumulated gradient is the mini-batch's: the
        micro-batch's share of what this type averages over (its rows of the mini-batch's for a
        per-sequence mean), as for a piece. So any split of a mini-batch (a short last one cut
        [6, 2]) gives the unsplit gradient; 1 / n_micro would weigh 6 rows as much as 2."""
        return self.piece_share(share_rows, share_tokens)

    def rank_weight(self, world: int, rows: int, all_rows: int, tokens: int, all_tokens: int) -> float:
        """DeepSpeed averages the ranks' gradients: a rank's loss is weighed by its share of the
        micro-batch (in the units this type averages over) x world. 1.0 on one process."""
        return world * rows / all_rows

    def rank_units(self, rows: int, tokens: int) -> float:
        """What a rank's loss metric counts for when the ranks' metrics are averaged."""
        return float(rows)

    def piece_share(self, share_rows: float, share_tokens: float) -> float:
        """Weight of one piece's loss when a micro-batch is cut into pieces by a token budget, so
        that the weighted pieces add up to the micro-batch's loss: the piece's share of what this
        type averages over."""
        return 1.0 if self.sums_micro_batches else share_rows


class BNPOLoss(LossType):
    """Each token of the micro-batch weighs the same; micro-batches weigh the same (TRL's bnpo: each
    accumulation step's token mean, divided by the steps). Its normaliser is the micro-batch's, so
    a split changes the loss by definition: [6, 2] rows is not the 8 rows' token mean."""

    name = "bnpo"

    def micro_batch_share(self, share_rows, share_tokens, n_micro):
        return 1.0 / n_micro

    def reduce(self, per_token, m, max_completion_length, num_items):
        return (per_token * m).sum() / m.sum().clamp(min=1)

    def rank_weight(self, world, rows, all_rows, tokens, all_tokens):
        return world * tokens / max(1, all_tokens)

    def rank_units(self, rows, tokens):
        return float(tokens)

    def piece_share(self, share_rows, share_tokens):
        return share_tokens


class DrGRPOLoss(LossType):
    """Constant normaliser (batch size x max completion length): no length bias."""

    name = "dr_grpo"

    def reduce(self, per_token, m, max_completion_length, num_items):
        return (per_token * m).sum() / (per_token.shape[0] * max_completion_length)

    def check(self, max_completion_length, num_items):
        if not max_completion_length:
            raise ValueError("policy_loss: loss type dr_grpo needs max_completion_length (the rollout's max_new_tokens)")


class DAPOLoss(LossType):
    """Each token of the mini-batch (one optimizer step's tokens) weighs the same: `num_items`
    counts them, spread over the ranks, so micro-batch and rank losses add up instead of
    averaging. TRL's after its PR #6024: the tokens of one accumulation window, not of the whole
    generation batch when that spans several optimizer steps."""

    name = "dapo"
    sums_micro_batches = True

    def reduce(self, per_token, m, max_completion_length, num_items):
        return (per_token * m).sum() / num_items

    def check(self, max_completion_length, num_items):
        if num_items is None or float(num_items) <= 0:
            raise ValueError(
                "policy_loss: loss type dapo needs num_items > 0, the active completion tokens of the mini-batch"
            )

    def rank_weight(self, world, rows, all_rows, tokens, all_tokens):
        return 1.0 if rows else 0.0

    def rank_units(self, rows, tokens):
        return min(float(rows), 1.0)


class ReinforceLoss(LossType):
    """Sequence log-prob times advantage, mean over sequences: no ratio, no clipping."""

    name = "reinforce"
    clipped = False

    def reduce(self, per_token, m, max_completion_length, num_items):
        return (per_token * m).sum(dim=1).mean()


LOSS_TYPES: dict[str, LossType] = {t.name: t for t in (LossType(), BNPOLoss(), DrGRPOLoss(), DAPOLoss(), ReinforceLoss())}


def loss_type(loss: LossConfig) -> LossType:
    """The `LossType` that owns `loss.type`'s arithmetic."""
    return LOSS_TYPES[loss.type]


KLEstimator = Literal["k1", "k2", "k3"]


# --------------------------------------------------------------------------- KL


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from the policy (Schulman 2020).

    With log r = ref - logp: k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2,
    k3 = r - 1 - log r (unbiased and >= 0).
    """
    log_r = ref_logprobs - logprobs  # [B, T]
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        # expm1 keeps r - 1 exact near r = 1, so the estimate never rounds below 0
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {estimator!r}")


def kl_penalised_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """KL in the reward instead of the loss: score - kl_coef * sum_t k1, per completion [B].

    k1 = logp - ref summed over the completion's active tokens is the sequence's log-ratio
    log pi(o) / pi_ref(o), the single-sample KL estimate of the whole completion.
    """
    same_shape = logprobs.shape == ref_logprobs.shape == mask.shape
    if not same_shape or scores.shape != logprobs.shape[:1]:
        raise ValueError(
            f"kl_penalised_rewards: expected scores [B] and logprobs/ref_logprobs/mask [B, T], got "
            f"{tuple(scores.shape)}, {tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    active = mask.bool()  # [B, T]
    k1 = (logprobs.detach() - ref_logprobs.detach()).masked_fill(~active, 0.0)  # [B, T]
    return scores - kl_coef * k1.sum(dim=1).to(scores.dtype)  # [B]


# --------------------------------------------------------------------------- policy loss




def _check_loss_args(
    logprobs, old_logprobs, advantages, mask, config, ref_logprobs, max_completion_length, num_items, entropy, sampler
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    same_shape = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "entropy": entropy,
                  "sampler_logprobs": sampler}
    for name, t in same_shape.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"policy_loss: advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    loss_type(config).check(max_completion_length, num_items)
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"policy_loss: kl_coef={config.kl_coef} > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"policy_loss: entropy_coef={config.entropy_coef} > 0 needs the per-token entropy")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items: int | float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate (or plain REINFORCE) + KL - entropy, aggregated per `config.type`.

    logprobs [B, T] (requires grad), old_logprobs / ref_logprobs / mask / entropy [B, T],
    advantages [B]. mask is 1 on the tokens the model sampled: 0 on padding and on what an
    episode's context put in the completion (tool results); positions where it is 0 count nowhere
    and may hold anything (0, -inf, NaN). sampler_logprobs [B, T]: the engine's, for
    `config.rollout_correction` (its detached weight multiplies the policy term; `pipeline.objective.correction`);
    None: the old policy sampled, nothing to correct.
    Aggregation uses this micro-batch's B and tokens, except dapo whose `num_items` counts the
    active tokens of the mini-batch (one optimizer step; TRL's accumulation window since its PR
    #6024), not of the whole generation batch. The trainer weighs each micro-batch's loss by its
    share of the mini-batch (`LossType.micro_batch_share`: rows for grpo, dr_grpo and reinforce, 1
    for dapo, 1 / micro-batches for bnpo), and DeepSpeed averages gradients over data-parallel
    ranks, so it passes num_items = mini-batch tokens / world_size for the update to be
    sum(tokens) / mini-batch tokens.
    Returns (loss, metrics) with detached float metrics under flat `section/name` keys.
    """
    _check_loss_args(
        logprobs, old_logprobs, advantages, mask, config, ref_logprobs, max_completion_length, num_items, entropy, sampler_logprobs
    )
    kind = loss_type(config)
    active = mask.bool()  # [B, T]
    # At least float32: bf16 cannot even count tokens past 256 exactly.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    m = active.to(dtype)  # [B, T]
    # Padding may hold -inf or NaN; zero it first so neither the sum nor the gradient sees it.
    logp = logprobs.to(dtype).masked_fill(~active, 0.0)  # [B, T]
    old = old_logprobs.detach().to(logp.dtype).masked_fill(~active, 0.0)  # [B, T]
    A = advantages.detach().to(logp.dtype)[:, None]  # [B, 1], one advantage per completion

    log_ratio = logp - old  # [B, T]
    if config.importance_level == "sequence":  # GSPO: one ratio per sequence, geometric mean over its tokens
        seq_log_ratio = (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = seq_log_ratio.expand_as(logp)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    capped = ratio.clamp(max=config.delta) if config.delta is not None else ratio  # [B, T]
    clipped = ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)  # [B, T]

    if not kind.clipped:
        pg_loss = -logp * A  # [B, T] plain policy gradient: no ratio, no clipping
    else:
        pg_loss = -torch.minimum(capped * A, clipped * A)  # [B, T] pessimistic (clipped) surrogate
    correction = None
    if config.rollout_correction.mode != "none" and sampler_logprobs is not None:  # w = pi_old / pi_sampler, detached, on the policy term (as TRL)
        w, correction = correction_weights(old_logprobs, sampler_logprobs, active, config.rollout_correction)  # [B, T]
        pg_loss = pg_loss * w.to(pg_loss.dtype)  # [B, T]
    kl = ent = None
    if ref_logprobs is not None:
        ref = ref_logprobs.detach().to(logp.dtype).masked_fill(~active, 0.0)  # [B, T]
        kl = kl_estimate(logp, ref, config.kl_estimator)  # [B, T]
    if entropy is not None:
        ent = entropy.to(logp.dtype).masked_fill(~active, 0.0)  # [B, T], keeps its graph: the bonus needs it
    per_token_loss = pg_loss  # [B, T]
    if config.kl_coef > 0:
        per_token_loss = per_token_loss + config.kl_coef * kl  # stay near the reference policy
    if config.entropy_coef > 0:
        per_token_loss = per_token_loss - config.entropy_coef * ent  # entropy bonus keeps exploring
    loss = kind.reduce(per_token_loss, m, max_completion_length, num_items)

    with torch.no_grad():
        n_active = m.sum().clamp(min=1)

        def token_mean(x: torch.Tensor) -> float:
            return float((x * m).sum() / n_active)

        if not kind.clipped:  # nothing is clipped
            low = high = torch.zeros_like(active)
        else:
            low = (ratio < 1 - config.clip_eps_low) & (A < 0)  # [B, T] clipped term active below
            high = (ratio > 1 + config.clip_eps_high) & (A > 0)  # [B, T] clipped term active above
        metrics = {
            "loss/total": float(loss),
            "loss/policy": float(kind.reduce(pg_loss, m, max_completion_length, num_items)),
            "ratio/mean": token_mean(ratio),
            "clip/ratio_low": token_mean(low.to(m.dtype)),
            "clip/ratio_high": token_mean(high.to(m.dtype)),
            "clip/ratio_region": token_mean((low | high).to(m.dtype)),
        }
        if kl is not None:
            metrics["kl/mean"] = token_mean(kl)
        if ent is not None:
            metrics["entropy/mean"] = token_mean(ent)
        metrics.update(correction or {})
    return loss, metrics
