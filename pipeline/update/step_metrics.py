"""A micro-batch's metrics over the data-parallel ranks, as one process would compute them."""

from __future__ import annotations

import math

import torch

from pipeline.objective.correction import EXTREMES


def across_ranks(metrics: dict[str, float], rows: int, tokens: int, kind, world: int) -> dict[str, float]:
    """Token means weighted by each rank's tokens, the loss by the units its type (`kind`, a
    `pipeline.objective.loss.LossType`) averages over; a loss that is a share of the mini-batch's
    (`sums_micro_batches`) adds up; the `EXTREMES` take the ranks' min / max, a rank without
    tokens (a zero-weight stand-in row) left out."""
    if world == 1:
        return metrics
    keys = sorted(k for k in metrics if k not in EXTREMES)
    w = [kind.rank_units(rows, tokens) if k.startswith("loss/") else float(tokens) for k in keys]
    t = torch.tensor([metrics[k] * wk if wk else 0.0 for k, wk in zip(keys, w)] + w, dtype=torch.float64)  # [2K]
    torch.distributed.all_reduce(t)
    K = len(keys)
    summed = kind.sums_micro_batches  # shares of the mini-batch's loss: the ranks' mean is their sum / world
    out = {
        k: float(t[i] / (world if summed and k.startswith("loss/") else max(float(t[K + i]), 1.0)))
        for i, k in enumerate(keys)
    }
    for key in sorted(k for k in metrics if k in EXTREMES):
        sign = -1.0 if EXTREMES[key] is max else 1.0  # a max is the min of the negated values
        v = metrics[key] if tokens and not math.isnan(metrics[key]) else float("inf") * sign
        x = torch.tensor([v * sign], dtype=torch.float64)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MIN)
        out[key] = float(x) * sign if torch.isfinite(x) else float("nan")
    return out
