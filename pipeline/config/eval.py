"""The `eval:` section of the run's configuration and the eval sets of `data.eval`.

    data:
      eval: data/eval.jsonl                   # one set (its figures are eval/<metric>)
      eval:                                   # or several, each reported as eval/<name>/<metric>
        gsm8k: data/gsm8k.jsonl
        hard: {path: data/hard.jsonl, reward: judge}   # its own accuracy reward
    eval: {samples: 8, temperature: 0.6, greedy: false, pass_k: [1, 4, 8]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field

from pipeline.config.base import Section


class EvalSet(Section):
    """One named eval set of `data.eval`: its file and, optionally, its own accuracy reward."""

    path: str
    """The set's prompts (same forms as data.train)."""
    reward: str | None = None
    """The reward column that counts as this set's accuracy; None: `eval.reward`."""


class EvalConfig(Section):
    """Periodic evaluation on data.eval."""

    every: int = Field(1, ge=0)
    """Evaluate every N iterations (and on the initial policy); 0 disables."""
    max_prompts: int = Field(200, ge=1)
    """Evaluate on at most this many eval prompts (the first ones) of each set."""
    greedy: bool = True
    """Greedy decoding (true) or sampling (with eval.temperature, and the rollout's other settings)."""
    reward: str = "correct"
    """Which reward column counts as accuracy (a reward > 0 is a hit); must name a reward when eval runs."""
    samples: int = Field(1, ge=1, le=1024)
    """k: completions per eval prompt, drawn in one engine call (n=k); > 1 needs greedy: false and
    adds pass@k and maj@k (docs/tracking.md)."""
    temperature: float | None = Field(None, gt=0.0)
    """Sampling temperature of the eval (greedy: false); None: rollout.temperature."""
    pass_k: list[int] = []
    """The k of pass@k and maj@k reported, each <= eval.samples; empty: k = eval.samples (when > 1)."""
    prompts_per_part: int | None = Field(None, ge=1)
    """Prompts per eval part (the unit of resume: a killed eval redoes only unfinished parts);
    None: one part per eval set."""

    def ks(self) -> list[int]:
        """The k of pass@k and maj@k."""
        return sorted(set(self.pass_k)) if self.pass_k else ([self.samples] if self.samples > 1 else [])


EVAL_NEUTRAL = {("eval", "samples"): 1, ("eval", "temperature"): None, ("eval", "pass_k"): [],
                ("eval", "prompts_per_part"): None}
"""The options added with k samples per prompt, at the value that does what evals did before."""

RESERVED = {"accuracy", "reward", "rewards", "mean_length", "episodes", "tools", "judge", "pass_at", "maj_at"}
"""Names an eval set cannot take: metric names' first segments (an MLflow file store keeps a metric as a file)."""
TAKEN = re.compile(r"(accuracy|reward|mean_length|(pass|maj)_at_\d+)(_lo|_hi)?|\.+")
"""More of them: a figure over all sets (eval/pass_at_4, eval/accuracy_lo) and `.`/`..`, which MLflow refuses in a name."""


@dataclass(frozen=True)
class SetRef:
    """An eval set as the stage runs it: `name` None for a plain `data.eval` path (figures eval/<metric>)."""

    name: str | None
    path: str
    reward: str

    @property
    def label(self) -> str:
        return self.name or "eval"


def eval_sets(data_eval, cfg: EvalConfig) -> list[SetRef]:
    """`data.eval` (a path, or a mapping of names to paths or EvalSets) as the sets to run, in order."""
    if data_eval is None:
        return []
    if isinstance(data_eval, str):
        return [SetRef(None, data_eval, cfg.reward)]
    out = []
    for name, s in data_eval.items():
        s = EvalSet(path=s) if isinstance(s, str) else s
        out.append(SetRef(name, s.path, s.reward or cfg.reward))
    return out
