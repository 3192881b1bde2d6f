"""grpo's side of `rollout.agent.verifiers` (docs/agents.md, "verifiers"): the command each episode
runs (vf_episode.py under the interpreter that has verifiers; grpo never imports verifiers itself),
`grpo init`'s check of the taskset, and the trace's rewards as reward columns.

At `grpo init` the program's `--check` names the taskset's rewards with verifiers' weights
(`@vf.reward(weight=...)`, a judge's `weight`); each becomes the reward `vf_<name>`
(fn pipeline.agents.endpoint.vf_run:trace_reward, that weight, kwargs {reward: name}), so the
row's total is verifiers' own Trace.reward (sum of score x weight). A reward `rewards:` already
names keeps the user's entry (its weight). The trace the episode wrote (canonical: vf_episode.py)
is in the record as `episode.agent.result.verifiers`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pipeline.agents.endpoint.process import command
from pipeline.errors import GRPOError

PROGRAM = str(Path(__file__).with_name("vf_episode.py"))
PREFIX = "vf_"
REWARD_FN = "pipeline.agents.endpoint.vf_run:trace_reward"
CHECK_TIMEOUT_S = 120


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


def run_argv(agent, copy_of) -> list[str]:
    """agent_argv with each argument mapped by `copy_of` (pipeline.rewards.loading's, inside `run_code`: the
    run's copies of its scripts, RUN/code), as rollout and eval start it."""
    cmd = agent_argv(agent)
    return [cmd[0], *map(copy_of, cmd[1:])]


def _ask(opts, *extra: str, tokenizer: str | None = None) -> str:
    if opts.path is not None and not Path(opts.path).is_dir():
        raise GRPOError(f"rollout.agent.verifiers.path {opts.path!r}: no such folder (read from the directory grpo runs in)")
    try:
        env = {**os.environ, **({"GRPO_TOKENIZER": tokenizer} if tokenizer else {})}
        out = subprocess.run(command(argv(opts) + list(extra)), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                             stdin=subprocess.DEVNULL, env=env)
    except FileNotFoundError:
        raise GRPOError(f"rollout.agent.verifiers.python {opts.python!r}: no such program") from None
    except subprocess.TimeoutExpired:
        raise GRPOError(f"rollout.agent.verifiers: loading taskset {opts.taskset!r} took over {CHECK_TIMEOUT_S} s") from None
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("grpo: ")]
        why = lines[-1][len("grpo: "):] if lines else (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise GRPOError(why)
    return out.stdout


def check(opts, model: str | None = None) -> dict[str, float]:
    """The taskset's rewards and their weights; a GRPOError (one line) when it cannot be run here
    (with client train: also when the episode has tools and the renderer, built for `model`'s
    tokenizer, parses no tool calls)."""
    from pipeline.run import gguf_import

    tokenizer = model
    if model and gguf_import.is_gguf_path(model):  # the converted folder, as the run's tokenizer is (run.model_source)
        tokenizer = str(gguf_import.converted(model, "model")[0].resolve())
    elif model and Path(model).is_dir():
        tokenizer = str(Path(model).resolve())
    return json.loads(_ask(opts, "--check", tokenizer=tokenizer).strip().splitlines()[-1])["rewards"]


def rows(opts, n: int) -> list[dict]:
    """The first n tasks as data rows ({prompt, vf_task}): what data.train holds for these episodes."""
    return [json.loads(line) for line in _ask(opts, "--rows", str(n)).splitlines() if line.strip()]


def reward_specs(opts, model: str | None = None) -> list[dict]:
    return [{"fn": REWARD_FN, "name": PREFIX + name, "weight": w, "kwargs": {"reward": name}} for name, w in check(opts, model).items()]


def trace_reward(completions, agent_results=None, reward: str = "", **kwargs) -> list[float | None]:
    """The trace's score of one verifiers reward per row (None where the episode has no trace or
    the reward did not run: left out of the total, as verifiers records None)."""
    out = []
    for r in agent_results if agent_results is not None else [None] * len(completions):
        trace = ((r or {}).get("verifiers") or {}).get("trace") or {}
        got = (trace.get("rewards") or {}).get(reward)
        out.append(None if got is None else float(got["score"]))
    return out
