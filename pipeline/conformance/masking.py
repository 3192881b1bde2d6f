"""Cases on the loss's masks: which tokens the token mean's numerator and denominator count. The
implementation asked is loss.py's `Objective` (its `loss_mask` and `model_tokens` are grpo's
`Batch.build` mask and the trainer's token count); the broken variants are the peers' bugs."""

from __future__ import annotations

from dataclasses import replace

from pipeline.conformance.case import Case
from pipeline.conformance.loss import OBJ_NA, Objective, _grad, _logp, _policy, _rel, grpo_objective


def pre_mask_denominator_objective() -> Objective:
    """TRL #6369: the numerator's mask drops the truncated completions (mask_truncated_completions),
    the denominator was counted before that, from every generated token."""
    return replace(grpo_objective(), model_tokens=lambda comps, masks: [len(c) for c in comps])


def unmasked_numerator_objective() -> Objective:
    """ROLL #444: the token mean's numerator sums every position, masked ones included."""
    base = grpo_objective()

    def loss(logp, old, adv, mask, loss_type, **kw):
        import torch
        return base.loss(logp, old, adv, torch.ones_like(mask), loss_type, **kw)

    return replace(base, loss=loss)


def masked_mean_experiment(obj: Objective) -> tuple[bool, str]:
    """Garbage (+-1e3 logprobs, NaN-free) on masked positions must change neither the loss nor the
    gradient: L = sum(l * m) / sum(m) over the model's tokens only (grpo: per sequence; dapo: per token)."""
    import torch

    W, y, mask, adv = _policy()
    errs = []
    for t in ("grpo", "dapo"):
        def clean(w, t=t):
            lp = _logp(w, y)
            return obj.loss(lp * mask, (lp * mask).detach(), adv, mask, t, num_items=obj.num_items(mask, mask))

        def dirty(w, t=t):
            lp = _logp(w, y)
            junk = torch.where(mask.bool(), lp, 1e3 * lp)  # masked positions: scaled, still attached to w
            return obj.loss(junk, junk.detach() + (1 - mask) * 3.0, adv, mask, t, num_items=obj.num_items(mask, mask))
        la, lb = float(clean(W)), float(dirty(W))
        errs.append(max(abs(la - lb) / max(abs(la), 1e-12), _rel(_grad(dirty, W), _grad(clean, W))))
    return max(errs) < 1e-12, "rel. change from masked garbage: " + ", ".join(f"{e:.2e}" for e in errs)


def kept_tokens_denominator_experiment(obj: Objective) -> tuple[bool, str]:
    """8 completions of lengths 1..6; rows 1, 4 and 6 are truncated and masked whole after sampling (as
    TRL's mask_truncated_completions does; grpo's episode mask, all 0), row 3 has a tool-result span
    masked. DAPO at ratio 1: per-token loss -A_i, so L = sum_kept(-A_i) / #kept exactly, with the
    trainer's num_items = sum of the rows' model tokens; a denominator counting the masked tokens
    (TRL #6369) shrinks L by #kept / #generated (here 16 / 28)."""
    import torch

    W, y, _, adv = _policy()
    lengths = [1 + (i * 5) % 6 for i in range(8)]  # 1, 6, 5, 4, 3, 2, 1, 6: 28 generated tokens
    comps = [[int(t) for t in y[i, :n]] for i, n in enumerate(lengths)]
    masks: list = [None] * 8
    for i in (1, 4, 6):
        masks[i] = [0] * lengths[i]  # truncated: masked whole
    masks[3] = [1, 0, 0, 1]  # a tool result inside the completion
    mask = obj.loss_mask(comps, masks)  # [8, 6]
    lp = _logp(W, y)
    num_items = float(sum(obj.model_tokens(comps, masks)))
    got = float(obj.loss(lp, lp.detach(), adv, mask, "dapo", num_items=num_items))
    kept = [(i, t) for i, n in enumerate(lengths) for t in range(n) if masks[i] is None or masks[i][t]]
    want = sum(-float(adv[i]) for i, _ in kept) / len(kept)
    err = abs(got - want) / abs(want)
    return err < 1e-12, f"L = {got:.6g}, sum_kept(-A) / #kept = {want:.6g} ({len(kept)} of {sum(lengths)} tokens kept): rel. error {err:.2e}"


def cases() -> list[Case]:
    return [
        Case("masked-token-mean", "the token mean's denominator counts only the tokens its numerator keeps",
             "TRL #6369, fixed by #6439", "dapo, ratio 1, rows masked after sampling: L = sum_kept(-A_i) / #kept exactly (num_items = the rows' model tokens)",
             kept_tokens_denominator_experiment, grpo_objective, pre_mask_denominator_objective, trl_na=OBJ_NA),
        Case("masked-positions-inert", "masked positions change neither the loss nor its gradient",
             "ROLL #444 (open)", "L = sum(l m) / sum(m); garbage where m = 0 changes loss and gradient by 0",
             masked_mean_experiment, grpo_objective, unmasked_numerator_objective, trl_na=OBJ_NA),
    ]
