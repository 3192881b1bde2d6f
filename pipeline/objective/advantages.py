"""Rewards into group-relative advantages, in NumPy (no I/O, no torch).

Score stage: `combine_rewards` -> `group_advantages` (and `group_stats` for the stored group
columns). The update's KL-in-reward path recomputes advantages with the same functions. They live
apart from the torch loss math in pipeline/objective/loss.py because the score stage needs nothing else of
torch: importing it cost `grpo score` about 1 s of its cold start. Every function here is checked
against hand-derived numbers in tests/test_grpo.py.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

StdKind = Literal["sample", "population"]


def combine_rewards(per_function: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Total reward per completion: the weighted sum over reward functions, skipping NaN.

    per_function [N, F] holds NaN where a function returned None (it does not apply to that
    completion). Its term is left out of the sum, as TRL does. A row where *every* function
    returned None gets NaN, not 0: TRL's nansum gives 0 there (and warns), which would pass
    for a real reward of 0 in the group statistics; NaN makes `group_advantages` leave the
    completion out of its group's mean/std and give it advantage 0.
    """
    per_function, weights = np.asarray(per_function), np.asarray(weights)
    if per_function.ndim != 2 or weights.shape != (per_function.shape[1],):
        raise ValueError(
            "combine_rewards: expected per_function [N, F] and weights [F], "
            f"got {per_function.shape} and {weights.shape}"
        )
    weighted = per_function * weights.astype(per_function.dtype)[None, :]  # [N, F]
    total = np.nansum(weighted, axis=1)  # [N]
    none_applied = np.isnan(per_function).all(axis=1)  # [N]
    return np.where(none_applied, np.nan, total).astype(per_function.dtype)


def _as_groups(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """rewards [N], group by group -> [N/G, G] in float64 (statistics are cheap; keep them exact)."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {rewards.shape}")
    if num_generations < 1 or rewards.size % num_generations:
        raise ValueError(f"{rewards.size} rewards do not split into groups of num_generations={num_generations}")
    return rewards.astype(np.float64).reshape(-1, num_generations)


def _out_dtype(rewards: np.ndarray) -> np.dtype:
    return rewards.dtype if np.issubdtype(rewards.dtype, np.floating) else np.dtype(np.float32)


def _nanstd(x: np.ndarray, axis: int, std: StdKind) -> np.ndarray:
    """Std over `axis` ignoring NaN; sample (Bessel, n - 1) or population (n). 0 when undefined."""
    valid = ~np.isnan(x)
    count = valid.sum(axis, keepdims=True)
    mean = np.where(valid, x, 0.0).sum(axis, keepdims=True) / np.maximum(count, 1)
    dev = np.where(valid, x - mean, 0.0)
    ddof = {"sample": 1, "population": 0}[std]
    return np.sqrt((dev**2).sum(axis) / np.maximum(count.squeeze(axis) - ddof, 1))


def _group_stats(grouped: np.ndarray, std: StdKind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    valid = ~np.isnan(grouped)  # [P, G]
    count = valid.sum(axis=1)  # [P]
    hi = np.where(valid, grouped, -np.inf).max(axis=1)  # [P]
    lo = np.where(valid, grouped, np.inf).min(axis=1)  # [P]
    # No signal: fewer than two rewards to compare, or all equal. Tested exactly (hi == lo), not
    # by std < tol: the mean of [0.1, 0.1, 0.1] is not exactly 0.1 in floating point.
    zero_std = (count < 2) | (hi == lo)  # [P]
    with np.errstate(invalid="ignore", divide="ignore"):  # an empty group's mean is NaN, on purpose
        nanmean = np.where(valid, grouped, 0.0).sum(axis=1) / count  # [P]
    mean = np.where(zero_std & (count > 0), lo, nanmean)  # [P], NaN if empty
    sd = np.where(zero_std, 0.0, _nanstd(grouped, axis=1, std=std))  # [P]
    sd = np.where(count == 0, np.nan, sd)
    return mean, sd, zero_std


def group_stats(
    rewards: np.ndarray, num_generations: int, std: StdKind = "sample"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group (mean [P], std [P], zero_std [P] bool) of rewards [N = P * G], group by group.

    NaN rewards are left out. zero_std marks groups without learning signal: all valid rewards
    equal, or fewer than two of them. Their std is exactly 0 and their mean exactly the common
    value; a group with no valid reward has mean and std NaN.
    """
    rewards = np.asarray(rewards)
    mean, sd, zero_std = _group_stats(_as_groups(rewards, num_generations), std)
    return mean.astype(_out_dtype(rewards)), sd.astype(_out_dtype(rewards)), zero_std


def group_advantages(
    rewards: np.ndarray,
    num_generations: int,
    scale: Literal["group", "batch", "none"] = "group",
    std: StdKind = "sample",
    eps: float = 1e-4,
    std_floor: float | None = None,
    batch_renorm: bool = False,
) -> np.ndarray:
    """Group-relative advantages A_i = (r_i - mean_group) / (std + eps), [N] in rewards' order.

    scale: divide by the group's std (GRPO), the whole batch's std (Lite PPO), or not at all
    (Dr. GRPO). std_floor replaces "+ eps" by max(std, std_floor). Completions of a zero_std
    group and completions whose reward is NaN get exactly 0. batch_renorm then re-centres and
    re-scales (A - mean) / (std + eps) over the completions that carry a signal; the others stay
    0 so that an all-equal group never pushes the policy.
    """
    rewards = np.asarray(rewards)
    grouped = _as_groups(rewards, num_generations)  # [P, G]
    mean, group_std, zero_std = _group_stats(grouped, std)  # [P] each
    centred = grouped - mean[:, None]  # [P, G]
    if scale == "group":
        denom = group_std[:, None]  # [P, 1]
    elif scale == "batch":
        denom = _nanstd(grouped.reshape(-1), axis=0, std=std)  # [] over every valid reward
    elif scale == "none":
        denom = None
    else:
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN and zero-std entries are masked below
        if denom is None:
            advantages = centred
        elif std_floor is not None:
            advantages = centred / np.maximum(denom, std_floor)
        else:
            advantages = centred / (denom + eps)
    signal = ~zero_std[:, None] & ~np.isnan(grouped)  # [P, G] completions that can teach something
    advantages = np.where(signal, advantages, 0.0)  # [P, G]
    if batch_renorm and signal.any():
        live = advantages[signal]  # [S]
        renormed = (advantages - live.mean()) / (_nanstd(live, axis=0, std=std) + eps)
        advantages = np.where(signal, renormed, 0.0)
    return advantages.reshape(-1).astype(_out_dtype(rewards))


def advantages_of(a, rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """The advantages of total rewards [N] (groups of `num_generations`) under the config's
    `advantages:` section `a` (pipeline.config.advantages.AdvantageConfig)."""
    return group_advantages(rewards, num_generations, scale=a.scale, std=a.std, eps=a.eps,
                            std_floor=a.std_floor, batch_renorm=a.batch_renorm)
