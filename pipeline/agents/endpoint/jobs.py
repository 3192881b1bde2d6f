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


ROUTE_PATHS = {"chat": "/v1/chat/completions", "tokens": "/inference/v1/generate"}


def other_route(e: EndpointEpisode, r: Request) -> str | None:
    """Why a turn on `r.route` cannot extend `e`, whose first turn fixed the other route (each route keeps its own
    record of the history: chat messages, or the client's token ids), or None (the route fixed by the first turn)."""
    if e.route is None:
        e.route = r.route
    if e.route == r.route:
        return None
    return (f"a turn on the {r.route} route ({ROUTE_PATHS[r.route]}) in an episode whose turns are on the {e.route} route "
            f"({ROUTE_PATHS[e.route]}): one episode's turns use one route")


def stops_unserved(runner, stop, stop_ids, prefix: str = "") -> str | None:
    """Why a request's `stop` strings or `stop_token_ids` cannot be honoured, or None. The engine stops on the run's
    rollout.stop strings and stop token ids alone (fixed when it starts, never per request): asking for some of them is
    served, anything else is refused (never silently ignored)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(x not in runner.cfg.stop for x in stops):
        return f"`{prefix}stop` {stops!r}: the engine stops on rollout.stop {list(runner.cfg.stop)!r} only"
    if stop_ids and any(t not in runner.stop_ids for t in stop_ids):
        return (f"`{prefix}stop_token_ids` {list(stop_ids)!r}: the engine stops on the run's stop token ids "
                f"{sorted(runner.stop_ids)!r} only (the model's end-of-turn tokens, fixed when it starts)")
    return None
