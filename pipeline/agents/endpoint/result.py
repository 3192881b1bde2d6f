"""The agent's own result: its reward and metrics, as reward and metric columns beside `rewards:`.

The contract (docs/agents.md, "The agent's result"). Each episode's agent finds in its environment
GRPO_RESULT_FILE, a path in a fresh directory of its own that does not exist yet. It may write
there, before it exits, one JSON object:

    {"reward": 0.75, "metrics": {"tool_calls": 2, "solved": true, "note": "short text"}}

- `reward`: a finite number, or null (no reward from the agent for this episode); optional.
- `metrics`: an object of names ([A-Za-z0-9_.-], at most 64 characters) to a finite number, a
  boolean, a string or null; optional.
- `verifiers`: an object, written by grpo's own verifiers program only (vf_episode.py: the canonical trace).
- No other key; at most 1 MiB.

What it wrote is read once the agent has exited (or been killed) and recorded in the episode
(`episode.agent.result`, canonical: reward a float, the metrics as written); a file that is missing,
not JSON or not this shape is recorded as `episode.agent.result_error` (one line why) with
`result` null, and the episode goes on to be scored: never a crash.

`grpo init` adds the reward `agent` (fn pipeline.agents.endpoint.result:agent_reward, weight 1)
to a run with `rollout.agent`, unless `rewards` names a reward `agent` already (then that entry's
weight is used, or 0 to only log it). Scored, it gives the column `reward_agent` (null where the
agent gave no reward: left out of the total, as any reward function's None) and, per metric, the
row column `extra_agent_<name>` and the iteration's mean `agent_<name>` for the numeric ones.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path

RESULT_ENV = "GRPO_RESULT_FILE"
REWARD_NAME = "agent"
REWARD_FN = "pipeline.agents.endpoint.result:agent_reward"
MAX_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _finite(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def read_result(path: Path) -> tuple[dict | None, str | None]:
    """(the result, canonical; None) or (None, why it is not one) for the file at `path`."""
    if not path.is_file():
        return None, f"no result file: the agent wrote nothing to {RESULT_ENV}"
    raw = path.read_bytes()
    if len(raw) > MAX_BYTES:
        return None, f"the result file has {len(raw)} bytes, more than {MAX_BYTES}"
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "the result file is not UTF-8 text"
    except ValueError as err:
        return None, f"the result file is not JSON ({err})"
    return check_result(value)


def check_result(value) -> tuple[dict | None, str | None]:
    if not isinstance(value, dict):
        return None, f"the result is a JSON {type(value).__name__}, not an object {{\"reward\": ..., \"metrics\": {{...}}}}"
    if extra := sorted(set(value) - {"reward", "metrics", "verifiers"}):
        return None, f"the result has the key {extra[0]!r}; it holds only \"reward\" and \"metrics\""
    if "verifiers" in value and not isinstance(value["verifiers"], dict):
        return None, "the result's verifiers (grpo's verifiers program: the canonical trace) is not an object"
    reward = value.get("reward")
    if reward is not None and not _finite(reward):
        return None, f"the result's reward is {json.dumps(reward)[:80]}, not a finite number or null"
    metrics = value.get("metrics", {})
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        return None, f"the result's metrics is a JSON {type(metrics).__name__}, not an object"
    for name, v in metrics.items():
        if not _NAME.fullmatch(name):
            return None, f"the result's metric name {name[:80]!r} is not 1-64 of letters, digits, _ . -"
        if not (v is None or isinstance(v, (bool, str)) or _finite(v)):
            return None, f"the result's metric {name!r} is {json.dumps(v)[:80]}, not a finite number, a boolean, a string or null"
    out = {"reward": None if reward is None else float(reward), "metrics": dict(sorted(metrics.items()))}
    if "verifiers" in value:
        out["verifiers"] = value["verifiers"]
    return out, None


def agent_results(records: list[dict | None]) -> list[dict | None]:
    """Each row's agent result (what the reward gets as `agent_results`), None where there is none."""
    return [((rec or {}).get("agent") or {}).get("result") for rec in records]


def _logged(v):
    return float(v) if isinstance(v, bool) else v


def agent_reward(completions, agent_results=None, log_extra=None, log_metric=None, **kwargs) -> list[float | None]:
    """The agent's own reward per row (None where it gave none); its metrics logged as columns
    `agent_<name>` and, for numbers and booleans, iteration means `agent_<name>`."""
    results = agent_results if agent_results is not None else [None] * len(completions)
    names = sorted({n for r in results if r for n in r["metrics"]})
    for name in names:
        values = [_logged(r["metrics"].get(name)) if r else None for r in results]
        if log_extra is not None:
            log_extra(f"{REWARD_NAME}_{name}", values)
        if log_metric is not None:
            for v in values:
                if v is not None and not isinstance(v, str):
                    log_metric(f"{REWARD_NAME}_{name}", v)
    return [None if r is None else r["reward"] for r in results]


def reward_spec() -> dict:
    return {"fn": REWARD_FN, "name": REWARD_NAME, "weight": 1.0}
