"""Environments: TRL 1.16's `environment_factory` contract, so a TRL environment class runs unchanged.

    rollout:
      environment: wordle_env.py:WordleEnv

- One instance per episode, made with no arguments (TRL: `environment_factory()`).
- `reset(**row)` before the first turn, with the dataset row (the prompt under its column
  name, every other column under its own); a string it returns is appended to the last user
  message of the prompt, as TRL does.
- Its public methods (not `reset`, not `get_reward`, not `_private`) are tools, beside
  `rollout.tools`, with the same requirements (type hints, docstring).
- Reward functions get `environments=[...]`, one per completion, as TRL passes them.

Differences from TRL, by design of separate stages:
- Scoring runs in another process (and `grpo replay` long after), so the instances reward
  functions get are rebuilt from each instance's attributes as they were at the end of its
  episode (stored in the episode record as JSON; a value JSON cannot hold is stored as its
  repr string), without calling __init__ or reset: no tool or environment code runs again.
- TRL pools and reuses instances across batches; here each episode gets a fresh one (no state
  leaks between episodes, so results do not depend on batching).
- `get_reward` is not added as a reward by itself: name it in `rewards`, e.g. a function
  `def env_reward(environments, **kw): return [e.get_reward() for e in environments]`.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Callable

from pipeline.errors import GRPOError

SKIPPED_METHODS = ("reset", "get_reward")


def load_environment(target: str) -> type:
    """The class named by `rollout.environment`, checked: it builds with no arguments and has a callable reset."""
    from pipeline.rewards.contract import _resolve

    label = f"rollout.environment {target!r}"
    try:
        cls = _resolve(target, os.getcwd())
    except GRPOError as err:
        raise GRPOError(f"{label}: {err}") from None
    if not inspect.isclass(cls):
        raise GRPOError(f"{label}: not a class (TRL's environment_factory makes one instance per episode)")
    if not callable(getattr(cls, "reset", None)):
        raise GRPOError(f"{label}: the class has no reset method (TRL requires reset(**row))")
    return cls


def make(cls: type, label: str = "rollout.environment") -> Any:
    try:
        return cls()
    except Exception as err:
        raise GRPOError(f"{label}: {cls.__name__}() raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None


def methods(instance: Any) -> list[Callable]:
    """The instance's tools: its public bound methods but reset and get_reward (TRL's rule)."""
    return [m for name, m in inspect.getmembers(instance, predicate=inspect.ismethod)
            if name not in SKIPPED_METHODS and not name.startswith("_")]


def reset(instance: Any, row: dict, label: str = "rollout.environment") -> str | None:
    """reset(**row); its observation (None or a string) for the last user message."""
    try:
        obs = instance.reset(**row)
    except Exception as err:
        raise GRPOError(f"{label}: reset raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if obs is not None and not isinstance(obs, str):
        raise GRPOError(f"{label}: reset returned {type(obs).__name__}; TRL's contract is None or a string")
    return obs


def observe(raw, observation: str | None):
    """The prompt's messages with the observation appended to the last user message (TRL: content + observation)."""
    if observation is None:
        return raw
    msgs = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
    last = msgs[-1]
    msgs[-1] = {**last, "content": (last.get("content") or "") + observation}
    return msgs


def snapshot(instance: Any) -> dict:
    """{"class": module:qualname, "state": attributes}: what scoring rebuilds the instance from."""
    state = {}
    for key, value in vars(instance).items():
        try:
            state[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            state[key] = repr(value)
    return {"class": f"{type(instance).__module__}:{type(instance).__qualname__}", "state": state}


def rebuild(cls: type, snap: dict) -> Any:
    """An instance of `cls` with the stored attributes, built without __init__ or reset."""
    instance = cls.__new__(cls)
    vars(instance).update(snap.get("state", {}))
    return instance
