"""How each loss type reduces its per-token losses (grpo, bnpo, dr_grpo, dapo, reinforce), and
how micro-batches, pieces and ranks add up under it. `LossConfig.kind` picks one; `policy_loss`
(pipeline/grpo.py) asks it and never names a type, so a new type is one subclass here. Its own
module, below both: the config names a type without torch's arithmetic, and the math imports the
types without the config."""

import torch

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
