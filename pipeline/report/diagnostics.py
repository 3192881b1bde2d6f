"""The usual GRPO failure signs, checked on a run's history after every iteration.

The "common issues" table of GRPO guides (flat rewards -> check the reward's variance; KL
explosion; collapse), made automatic: each rule reads the per-iteration metrics of
`pipeline.report.inspect.history` and names the iteration and the metric that triggered it.
`grpo status` shows them; `pipeline.report.tracking` logs them when an update finishes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

ZERO_STD_MOST = 0.8
"""Share of zero-spread groups that counts as "most". Healthy runs on the demo task sit at
0.4-0.7 (see ENVIRONMENT.md), so the warning is kept for runs that have nearly no signal."""
KL_FLOOR = 0.02
"""KL per token below which growth is not worth a warning (noise around zero doubles easily)."""
KL_GROWTH = 2.0
"""KL rising fast: more than this factor above the previous iteration's."""
CLIPPED_MOST = 0.5
"""Share of completions truncated at rollout.max_new_tokens that counts as "most"."""
LENGTH_COLLAPSE = 0.5
"""Mean completion length below this fraction of the longest earlier mean: collapsing."""
LENGTH_MIN = 4.0
"""Earlier mean lengths (tokens) below which a drop is not called a collapse."""
CORRECTION_CUT_MOST = 0.2
"""Share of an iteration's completions whose `loss.rollout_correction` weight is truncated or
masked above which it warns: the correction then discards or reshapes much of the signal."""


@dataclass(frozen=True)
class Finding:
    iteration: int
    metric: str
    value: float
    message: str

    def __str__(self) -> str:
        return f"iteration {self.iteration}: {self.metric} = {self.value:.3g}: {self.message}"

    def as_dict(self) -> dict:
        return {**asdict(self), "text": str(self)}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def diagnose(rows: list[dict]) -> list[Finding]:
    """Every warning the history `rows` (one dict per iteration, ascending) gives, in order."""
    out: list[Finding] = []
    prev_kl = None
    longest = None
    for row in rows:
        k = row["iteration"]
        z = row.get("frac_reward_zero_std")
        if _ok(z) and z >= ZERO_STD_MOST:
            out.append(Finding(k, "frac_reward_zero_std", z,
                               f"{z:.0%} of groups have rewards with no spread: no learning signal, check the reward"))
        for key, v in row.items():
            if key.startswith("rewards/") and key.endswith("/frac_null") and _ok(v) and v >= 1.0:
                fn = key[len("rewards/"):-len("/frac_null")]
                out.append(Finding(k, key, v, f"reward function {fn!r} returned None for every completion"))
        kl = row.get("kl/mean")
        if _ok(kl):
            if prev_kl is not None and kl >= KL_FLOOR and kl > KL_GROWTH * prev_kl:
                out.append(Finding(k, "kl/mean", kl,
                                   f"KL rising fast ({prev_kl:.3g} -> {kl:.3g} in one iteration): lower train.lr or raise loss.kl_coef"))
            prev_kl = kl
        clipped = row.get("completions/clipped_ratio")
        if _ok(clipped) and clipped > CLIPPED_MOST:
            out.append(Finding(k, "completions/clipped_ratio", clipped,
                               f"{clipped:.0%} of completions were truncated: raise rollout.max_new_tokens or penalise length"))
        length = row.get("completions/mean_length")
        if _ok(length):
            if longest is not None and longest >= LENGTH_MIN and length < LENGTH_COLLAPSE * longest:
                out.append(Finding(k, "completions/mean_length", length,
                                   f"mean completion length collapsing ({longest:.1f} -> {length:.1f} tokens): check for a degenerate policy"))
            longest = length if longest is None else max(longest, length)
        cut = row.get("rollout_correction/clipped_seq_frac")
        if _ok(cut) and cut > CORRECTION_CUT_MOST:
            gap = row.get("logprobs/sampler_gap_mean")
            out.append(Finding(k, "rollout_correction/clipped_seq_frac", cut,
                               f"loss.rollout_correction truncated or masked the weight of {cut:.0%} of completions"
                               + (f" (sampler gap {gap:.3g} a token)" if _ok(gap) else "")
                               + ": the sampler is far from the trainer's policy; see docs/off-policy.md"))
    return out


__all__ = ["Finding", "diagnose"]
