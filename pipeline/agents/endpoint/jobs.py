"""What the endpoint's two routes share (chat: runner.py, tokens: tokens.py): the model name an
episode's turns ask for, the seeds' extra parts, and the engine job one request becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.agents.endpoint.runner import EndpointEpisode
    from pipeline.agents.endpoint.server import Request

MODEL = "policy"
"""The model name an episode's turns ask for (GRPO_MODEL); any other name is a side call."""
SIDE_SEED, AGENT_SEED = 2, 3  # GRPO_SEED: derive_seed(group seed, sample, 0, 3), four parts where a turn has three (no turn's seed)


@dataclass
class Job:
    e: EndpointEpisode
    r: Request
    kind: str  # "turn" | "side"
    prompt: list[int]
    seed: int
    cap: int
    entry: dict
