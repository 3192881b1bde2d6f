"""Environments: TRL 1.16's `environment_factory` contract, so a TRL environment class runs unchanged.

    rollout:
      environment: wordle_env.py:WordleEnv                      # one environment for every row
      environment: {coding: envs.py:CodingEnv, game: envs.py:GameEnv}   # routed by the `environment` column

- Instances are made with no arguments (TRL: `environment_factory()`) and pooled as TRL pools
  them: one per concurrent episode slot, reused across episodes with `reset`, so `__init__` runs
  once per slot in a rollout process. A slot is an episode's place among the episodes of its
  environment that run together, i.e. in one rollout part (the i-th episode of a part that uses
  environment X gets X's slot i); parts run one after another in a process, so the pool of a
  process holds as many instances of X as one part has episodes of X. The slot is recorded.
- `reset(**row)` before the first turn, with the dataset row (the prompt under its column name,
  every other column under its own; with a mapping the `environment` column is not passed, as
  TRL does), under `random.seed(the group's seed)` (numpy's global generator too, when numpy is
  loaded), so a reset that draws its task at random draws the same one for the G episodes of a
  group and on every rerun. A string, or a list of text parts, it returns is appended to the last
  user message (TRL: content + observation); a dataset with no prompt column (environment-owned
  data) gives an empty user message, so the observation is the prompt, and reset gets no prompt
  argument (TRL passes the row as it is).
- Its public methods (not `reset`, not `get_reward`, not `_private`; the class's functions, as TRL
  lists them: staticmethods too, not classmethods or callables stored on the instance) are tools, beside
  `rollout.tools`, with the same requirements (type hints, docstring); with a mapping, a row is
  offered its own environment's methods only.
- Reward functions get `environments=[...]`, one per completion, as TRL passes them. A class
  with `get_reward` is a reward source by itself (named after the class, weight 1, sync or
  async): `grpo init` writes it into the run's `rewards` (fn pipeline.agents.environment:get_reward),
  so `rewards` may be empty then; a row of another class gets None (not counted), as in TRL.

Differences from TRL, by design of separate stages:
- Scoring runs in another process (and `grpo replay` long after), so the instances reward
  functions (and get_reward) get are rebuilt from each instance's state at the end of its episode,
  stored exactly in the episode record (pipeline.agents.state), without calling __init__ or reset:
  no tool or environment code runs again. State the record cannot hold exactly (a connection, a
  lock) stops the rollout with one line; define __getstate__/__setstate__ to store what rebuilds it.
- What a pooled instance keeps from one episode to the next besides what reset sets (a cache, a
  counter) is not in the record; records stay byte-identical across reruns, shards and resumes
  as long as reset sets each episode's state (TRL's contract).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from pipeline.agents import state
from pipeline.agents.execution import seeded
from pipeline.errors import GRPOError

SKIPPED_METHODS = ("reset", "get_reward")
ROUTE_COLUMN = "environment"
"""The dataset column that picks a row's environment when rollout.environment is a mapping (TRL's name)."""


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def load_environment(target: str, label: str | None = None) -> type:
    """The class named by a `rollout.environment` target, checked: a class with a callable reset."""
    from pipeline.rewards.contract import resolve

    label = label or f"rollout.environment {target!r}"
    try:
        cls = resolve(target)
    except GRPOError as err:
        raise GRPOError(f"{label}: {err}") from None
    if not inspect.isclass(cls):
        raise GRPOError(f"{label}: not a class (TRL's environment_factory makes one instance per episode)")
    if not callable(getattr(cls, "reset", None)):
        raise GRPOError(f"{label}: the class has no reset method (TRL requires reset(**row))")
    return cls


def load_environments(spec: str | dict[str, str] | None) -> dict[str | None, type]:
    """{name: class}: {None: class} for one environment, the mapping's names for several."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        return {None: load_environment(spec)}
    return {name: load_environment(t, f"rollout.environment.{name} {t!r}") for name, t in spec.items()}


def route(classes: dict, columns: dict, where: str) -> str | None:
    """The name of a row's environment: None with one environment, else its `environment` column's value."""
    if None in classes:
        return None
    name = columns.get(ROUTE_COLUMN)
    if name not in classes:
        raise GRPOError(f"{where}: column {ROUTE_COLUMN!r} is {name!r}, not one of rollout.environment's names "
                        f"({', '.join(sorted(classes))})")
    return name


def make(cls: type, label: str = "rollout.environment") -> Any:
    try:
        return cls()
    except Exception as err:
        raise GRPOError(f"{label}: {cls.__name__}() raised {type(err).__name__}: {_first_line(err)}") from None


_POOLS: dict[tuple, list] = {}  # (name, class) -> its instances, in slot order, for this process
_BUSY: dict[int, tuple] = {}  # id(instance) -> (pool key, slot) while an episode holds it


def acquire(name: str | None, cls: type, label: str) -> tuple[Any, int]:
    """The lowest free slot's instance of this environment (made on first need: __init__ once per slot)."""
    pool = _POOLS.setdefault((name, cls), [])
    slot = next((i for i, inst in enumerate(pool) if inst is None or id(inst) not in _BUSY), len(pool))
    if slot == len(pool) or pool[slot] is None:
        instance = make(cls, label)
        pool[slot:slot + 1] = [instance]
    instance = pool[slot]
    _BUSY[id(instance)] = ((name, cls), slot)
    return instance, slot


def release(instance: Any, drop: bool = False) -> None:
    """The episode is recorded: its instance may serve the next one (drop: made anew for the next)."""
    held = _BUSY.pop(id(instance), None)
    if drop and held is not None:
        _POOLS[held[0]][held[1]] = None


def methods(instance: Any) -> list[Callable]:
    """The instance's tools, by TRL's rule: the functions of its class (staticmethods too; not
    classmethods, properties, or callables stored on the instance), public, but reset and get_reward,
    each as the instance gives it. Listed on the class: getmembers on the instance runs properties."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in SKIPPED_METHODS and not name.startswith("_")]


def reset(instance: Any, row: dict, label: str = "rollout.environment", seed: int | None = None) -> str | None:
    """reset(**row) under random.seed(seed); its observation (None or text) for the last user message."""
    try:
        with seeded(seed):
            obs = instance.reset(**row)
    except Exception as err:
        raise GRPOError(f"{label}: reset raised {type(err).__name__}: {_first_line(err)}") from None
    if isinstance(obs, list):  # TRL accepts content parts; text ones are text here (no images in this pipeline)
        bad = [p for p in obs if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))]
        if bad:
            raise GRPOError(f"{label}: reset returned a content part {str(bad[0])[:80]}; only text parts "
                            "({'type': 'text', 'text': ...}) are supported here")
        obs = "".join(p["text"] for p in obs)
    if obs is not None and not isinstance(obs, str):
        raise GRPOError(f"{label}: reset returned {type(obs).__name__}; TRL's contract is None, a string or a list of content parts")
    return obs


def observe(raw, observation: str | None):
    """The prompt's messages with the observation appended to the last user message (TRL: content + observation)."""
    if observation is None:
        return raw
    msgs = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
    last = msgs[-1]
    msgs[-1] = {**last, "content": (last.get("content") or "") + observation}
    return msgs


# ------------------------------------------------------------------------ get_reward as a reward
REWARD_FN = "pipeline.agents.environment:get_reward"
REWARD_FN_ASYNC = "pipeline.agents.environment:get_reward_async"


def reward_specs(spec: str | dict[str, str] | None) -> list[dict]:
    """The rewards TRL adds for environment classes that define get_reward: one per class, named
    after it, weight 1 (what `grpo init` writes into the run's `rewards`)."""
    targets = {None: spec} if isinstance(spec, str) else dict(spec or {})
    out, seen = [], set()
    for name, target in targets.items():
        cls = load_environment(target, f"rollout.environment{'.' + name if name else ''} {target!r}")
        if cls in seen or not callable(getattr(cls, "get_reward", None)):
            continue
        seen.add(cls)
        fn = REWARD_FN_ASYNC if inspect.iscoroutinefunction(cls.get_reward) else REWARD_FN
        out.append({"fn": fn, "name": cls.__name__, "weight": 1.0, "kwargs": {"environment_class": target}})
    return out


def get_reward(environments, environment_class: str, **kwargs) -> list[float | None]:
    """TRL's reward of an environment class: e.get_reward() for the episodes of exactly that class, None for others."""
    cls = load_environment(environment_class)
    return [e.get_reward() if type(e) is cls else None for e in environments]


async def get_reward_async(environments, environment_class: str, **kwargs) -> list[float | None]:
    """get_reward for a class whose get_reward is async."""
    cls = load_environment(environment_class)
    return [await e.get_reward() if type(e) is cls else None for e in environments]


def instances(spec: str | dict[str, str] | None, records: list[dict | None]) -> list:
    """Each episode's instance rebuilt from its record (None where a row has no environment)."""
    classes = load_environments(spec)
    out = []
    for r in records:
        snap = None if r is None else r.get("environment")
        out.append(None if snap is None else rebuild(classes[snap.get("name") if None not in classes else None], snap))
    return out


# ---------------------------------------------------------------------------- the stored state
def snapshot(instance: Any) -> dict:
    """{"class": module:qualname, "codec": 1, "state": ...}: what scoring rebuilds the instance from,
    its __getstate__ (its attributes; slot values too) in the exact encoding of pipeline.agents.state.
    State that encoding cannot hold stops the rollout with one line (GRPOError)."""
    cls = type(instance)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "codec": state.CODEC,
            "state": state.encode(instance.__getstate__(), cls.__name__, instance=True)}


def rebuild(cls: type, snap: dict) -> Any:
    """An instance of `cls` with the stored state, built without __init__ or reset (its __setstate__
    when it has one). A record written before the exact encoding holds plain attributes (JSON, or a
    repr string where JSON could not hold the value): restored as they are."""
    instance = cls.__new__(cls)
    if snap.get("codec") is None:
        vars(instance).update(snap.get("state", {}))
        return instance
    return state.set_state(instance, state.decode(snap["state"]))


def describe(snap: dict) -> str:
    """The stored state as one readable line (`grpo inspect`): attribute=value, as Python prints them."""
    name = snap.get("class", "?").rpartition(":")[2]
    if snap.get("codec") is None:
        return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in snap.get("state", {}).items()) + ")"
    return state.describe({"$": "object", "class": snap.get("class", "?"), "state": snap["state"]}, width=10**9)
