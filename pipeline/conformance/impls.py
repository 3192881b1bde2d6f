"""The small interfaces the experiments ask an implementation through, shared by the case modules and
the TRL adapter (which builds them on TRL's code); see each case module for what its experiments ask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Scorer:
    """`advantages(per_function [N, F], weights [F], G)` -> A [N]; `contract(values)` -> the float64
    column one reward function's output is stored as."""

    advantages: Callable[[np.ndarray, np.ndarray, int], np.ndarray]
    contract: Callable[[list], np.ndarray]


@dataclass(frozen=True)
class Logprober:
    """`logprobs(model, prompt_ids, completion_ids, T)` -> per-token logprobs [B, T'] of the completions."""

    model: Any
    logprobs: Callable


def outcome_only(completions, **kwargs) -> list[float | None]:
    """A TRL-contract reward for the default-0.0 case (TRL #6427's table): -1 for a submitted wrong
    answer, None for a completion that submitted nothing (nothing to score)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [(-1.0 if "submit" in t else None) for t in texts]
