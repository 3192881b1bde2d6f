"""grpo's side of `rollout.agent.verifiers` (docs/agents.md, "verifiers"): the command each episode
runs (vf_episode.py under the interpreter that has verifiers; grpo never imports verifiers itself),
`grpo init`'s check of the taskset, and the trace's rewards as reward columns.

At `grpo init` the program's `--check` names the taskset's rewards with verifiers' weights
(`@vf.reward(weight=...)`, a judge's `weight`); each becomes the reward `vf_<name>`
(fn pipeline.agents.endpoint.vf_run:trace_reward, that weight, kwargs {reward: name}), so the
row's total is verifiers' own Trace.reward (sum of score x weight). A reward `rewards:` already
names keeps the user's entry (its weight). The trace the episode wrote (canonical: vf_episode.py)
is in the record as `episode.agent.result.verifiers`.

`grpo replay` of such a run re-scores the trace rewards (`rescore`): one `vf_episode.py --score`
process per score part (vf_score.py: verifiers' own `Task.score(trace, runtime=None)` on the recorded
messages; no harness, runtime, interception server or engine). A reward that reads the runtime is not
replayable: its recorded score is kept, a line names it, and the row column `extra_vf_<name>_replay`
says which score each row holds (`rescored` or `recorded`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

from pipeline.agents.endpoint.process import command
from pipeline.config.agent_command import PROGRAM, agent_argv, argv, options_json  # noqa: F401 (named here too)
from pipeline.errors import GRPOError

PREFIX = "vf_"
REWARD_FN = "pipeline.agents.endpoint.vf_run:trace_reward"
CHECK_TIMEOUT_S = 120
SCORE_TIMEOUT_S = 600


def run_argv(agent, copy_of) -> list[str]:
    """agent_argv with each argument mapped by `copy_of` (pipeline.rewards.loading's, inside `run_code`: the
    run's copies of its scripts, RUN/code), as rollout and eval start it."""
    cmd = agent_argv(agent)
    return [cmd[0], *map(copy_of, cmd[1:])]


def _ask(opts, *extra: str, tokenizer: str | None = None, stdin: str | None = None, timeout: float = CHECK_TIMEOUT_S) -> str:
    if opts.path is not None and not Path(opts.path).is_dir():
        raise GRPOError(f"rollout.agent.verifiers.path {opts.path!r}: no such folder (read from the directory grpo runs in)")
    try:
        env = {**os.environ, **({"GRPO_TOKENIZER": tokenizer} if tokenizer else {})}
        out = subprocess.run(command(argv(opts) + list(extra)), capture_output=True, text=True, timeout=timeout, env=env,
                             **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}))
    except FileNotFoundError:
        raise GRPOError(f"rollout.agent.verifiers.python {opts.python!r}: no such program") from None
    except subprocess.TimeoutExpired:
        raise GRPOError(f"rollout.agent.verifiers: taskset {opts.taskset!r} ({' '.join(extra[:1])}) took over {timeout} s") from None
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
    from pipeline.run.run import model_source

    tokenizer = model  # a local model as the run reads it: a GGUF file's converted folder (run.model_source)
    if model and (gguf_import.is_gguf_path(model) or Path(model).is_dir()):
        tokenizer = str(model_source(model)[0].resolve())
    return json.loads(_ask(opts, "--check", tokenizer=tokenizer).strip().splitlines()[-1])["rewards"]


def rows(opts, n: int) -> list[dict]:
    """The first n tasks as data rows ({prompt, vf_task}): what data.train holds for these episodes."""
    return [json.loads(line) for line in _ask(opts, "--rows", str(n)).splitlines() if line.strip()]


def reward_specs(opts, model: str | None = None) -> list[dict]:
    return [{"fn": REWARD_FN, "name": PREFIX + name, "weight": w, "kwargs": {"reward": name}} for name, w in check(opts, model).items()]


def trace_reward(completions, agent_results=None, reward: str = "", log_extra=None, **kwargs) -> list[float | None]:
    """The trace's score of one verifiers reward per row (None where the episode has no trace or
    the reward did not run: left out of the total, as verifiers records None). In a replay
    (`rescore`), the column `extra_vf_<reward>_replay` says where each row's score comes from."""
    out, source = [], []
    for r in agent_results if agent_results is not None else [None] * len(completions):
        vf = (r or {}).get("verifiers") or {}
        got = ((vf.get("trace") or {}).get("rewards") or {}).get(reward)
        out.append(None if got is None else float(got["score"]))
        replay = vf.get("replay")
        source.append(None if replay is None else "recorded" if reward in replay["recorded"] or "skipped" in replay else "rescored")
    if log_extra is not None and any(s is not None for s in source):
        log_extra(f"{PREFIX}{reward}_replay", source)
    return out


def rescore(opts, results: list[dict | None], tasks: list) -> list[dict | None]:
    """`results` (each row's agent result) with each trace's rewards re-scored by verifiers' own
    `Task.score(trace, runtime=None)` in one scoring process (vf_score.py), and `verifiers.replay`
    naming the rewards re-scored and those kept as recorded (they read the runtime)."""
    traced = [i for i, r in enumerate(results) if ((r or {}).get("verifiers") or {}).get("trace") is not None]
    if not traced:
        return results
    lines = "".join(json.dumps({"vf_task": tasks[i], "trace": results[i]["verifiers"]["trace"]}, sort_keys=True) + "\n" for i in traced)
    got = [json.loads(ln) for ln in _ask(opts, "--score", stdin=lines, timeout=SCORE_TIMEOUT_S).splitlines() if ln.startswith("{")]
    if len(got) != len(traced):
        raise GRPOError(f"rollout.agent.verifiers: the scoring process answered {len(got)} of {len(traced)} traces")
    out = list(results)
    kept: set[str] = set()
    for i, g in zip(traced, got):
        r = out[i] = copy.deepcopy(results[i])
        trace = r["verifiers"]["trace"]
        old = trace.get("rewards") or {}
        if "skipped" in g:  # not re-scored (an errored rollout, a scoring that raised): every recorded score kept
            r["verifiers"]["replay"] = {"rescored": [], "recorded": sorted(old), "skipped": g["skipped"]}
            print(f"grpo: replay: a verifiers trace (vf_task {tasks[i]}) is not re-scored, {g['skipped']}: its recorded "
                  "scores are kept", flush=True)
            continue
        trace["rewards"] = dict(sorted({**{k: old[k] for k in g["not_replayable"]}, **g["rewards"]}.items()))
        r["verifiers"]["replay"] = {"rescored": sorted(g["rewards"]), "recorded": g["not_replayable"]}
        kept.update(g["not_replayable"])
    for name in sorted(kept):
        print(f"grpo: replay: the verifiers reward {name!r} reads the runtime (no runtime runs in a replay): not replayable, "
              f"its recorded score is kept (column extra_{PREFIX}{name}_replay)", flush=True)
    return out
