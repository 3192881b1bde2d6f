"""The program grpo starts per episode for `rollout.agent` (docs/agents.md): its `command`, or the
verifiers program (pipeline/agents/endpoint/vf_episode.py, under `rollout.agent.verifiers.python`).
Here, below the store, so that the run's code record (pipeline/store/code.py) names the scripts it
runs without importing the agents."""

from __future__ import annotations

import json
from pathlib import Path

PROGRAM = str(Path(__file__).parent.parent / "agents" / "endpoint" / "vf_episode.py")

NEUTRAL = {"client": "eval", "renderer": None}
"""Options added after the program's command line was first stamped: left out at these values, so a
run made before them starts (and stamps) the same command."""


def options_json(opts) -> str:
    data = {k: v for k, v in opts.model_dump(mode="json", exclude={"python"}).items() if k not in NEUTRAL or v != NEUTRAL[k]}
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def argv(opts) -> list[str]:
    return [opts.python, PROGRAM, "--config", options_json(opts)]


def agent_argv(agent) -> list[str]:
    """The program grpo starts per episode for `rollout.agent`: its `command`, or this verifiers program."""
    return list(agent.command) if agent.command is not None else argv(agent.verifiers)
