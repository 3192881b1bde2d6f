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


def again(e: EndpointEpisode, r: Request) -> bool:
    """The same body again (a client's retry, which timing drives; the turn that ended the episode included):
    answered as it was, nothing recorded, so a part's bytes never depend on retries."""
    h = r.digest
    answer = e.last[1:] if h and e.last is not None and e.last[0] == h else e.side_answers.get(h)
    if answer is not None:
        r.answer(*answer)
    return answer is not None


def side_refused(runner, e: EndpointEpisode, prompt_len: int) -> str | None:
    """Why a side call is refused (its prompt too long; rollout.agent.max_side_calls used up), or None."""
    if prompt_len > runner.max_prompt_len:
        return f"side call: {prompt_len} prompt tokens, more than {runner.max_prompt_len}"
    cap = runner.cfg.agent.max_side_calls
    if cap is not None and e.sides >= cap:
        return f"side call: the episode has made its rollout.agent.max_side_calls ({cap})"
    return None
