"""One verifiers (0.4, v1 API) episode against grpo's endpoint: the agent program grpo starts per
episode for `rollout.agent.verifiers` (pipeline/config/agents.py; docs/agents.md, "verifiers").

Standalone on purpose: it imports verifiers and the standard library only, never grpo, so it runs
under whichever interpreter has verifiers (`rollout.agent.verifiers.python`; grpo's own with the
`verifiers` extra). grpo starts it as `PYTHON vf_episode.py --config JSON` with OPENAI_BASE_URL,
OPENAI_API_KEY, GRPO_MODEL, GRPO_TASK and GRPO_RESULT_FILE in its environment (as any endpoint agent).

The episode is what `vf-eval` runs for one slot: `Env.run_episode(task, ModelContext(...))` inside
`env.serving()`, verifiers' eval client pointed at grpo's endpoint (it relays each chat body as the
harness sent it; grpo keeps the tokens), or with `client: train` verifiers' train client (its renderer,
built for GRPO_TOKENIZER, renders the token ids and POSTs them to grpo's tokens route,
/inference/v1/generate: pipeline/agents/endpoint/tokens.py). The task is the taskset's `vf_task`-th (the row's column;
`--rows N` prints N such rows). It writes GRPO_RESULT_FILE as
{"reward": the trace's weighted total (verifiers' Trace.reward), "metrics": the trace's metrics,
 "verifiers": the canonical trace: task key and hash, messages, rewards {name: {score, weight}},
 metrics, stop condition, errors (type and message), ok / is_timeout, its number of branches, on
 the tokens route each sampled node's ids; no id, timestamp or timing}.

`--score` re-scores recorded traces with no harness, runtime or model (vf_score.py: `grpo replay`).

`--check` prints {"rewards": {name: weight}} for the taskset's first task (what `grpo init` turns
into reward columns), or one line on stderr and exit status 2: a taskset that does not import or
exports no Taskset, a remote runtime, an Env other than SingleAgentEnv (several traces per episode),
with client train a renderer that does not build for GRPO_TOKENIZER, or parses no tool calls or renders
no tool schemas (a chat template without tools) while the episode has tools (a harness other than `null`,
toolsets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

LOCAL_RUNTIMES = ("subprocess",)
TASK_COLUMN = "vf_task"


class Refused(Exception):
    pass


def env_config(cfg: dict) -> dict:
    """The verifiers EnvConfig data for grpo's `rollout.agent.verifiers` (v1 ids as vf-eval takes them)."""
    runtime = cfg.get("runtime") or "subprocess"
    if runtime not in LOCAL_RUNTIMES:
        raise Refused(f"rollout.agent.verifiers.runtime {runtime!r}: only a local runtime ({', '.join(LOCAL_RUNTIMES)}) "
                      "runs against grpo's loopback endpoint")
    agent = {"runtime": {"type": runtime}}
    if cfg.get("harness"):
        agent["harness"] = {"id": cfg["harness"]}
    return {"id": cfg.get("env") or "", "taskset": {"id": cfg["taskset"], **(cfg.get("taskset_args") or {})}, "agent": agent}


def seated(data: dict) -> dict:
    """`data` with the harness and runtime on every seat the Env declares (`agent` for SingleAgentEnv)."""
    import verifiers.v1 as vf

    cls = vf.env_config_type(data["taskset"]["id"], data["id"])
    seats = [n for n, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
    agent = data.pop("agent")
    return {**data, **{n: agent for n in seats}}


def load(cfg: dict):
    """(env, taskset) for the config; Refused with one line when the taskset cannot be used."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise Refused(f"rollout.agent.verifiers: verifiers is not importable by {sys.executable} ({err}); "
                      "pip install 'grpo[verifiers]' or set rollout.agent.verifiers.python") from None
    data = env_config(cfg)
    ts = cfg["taskset"]
    if cfg.get("path"):  # the taskset's folder: its module and the siblings it imports, here and in every child
        where = os.path.abspath(cfg["path"])  # (the subprocess runtime's processes inherit this environment)
        sys.path.insert(0, where)
        os.environ["PYTHONPATH"] = os.pathsep.join([where, *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        module = vf.import_taskset(ts)
    except ImportError as err:
        raise Refused(f"rollout.agent.verifiers.taskset {ts!r} does not import: {str(err).splitlines()[0]}") from None
    from verifiers.v1.utils.loaders import _plugin_class

    try:
        _plugin_class(module, vf.Taskset, "taskset")
    except (AttributeError, TypeError, ValueError) as err:
        raise Refused(f"rollout.agent.verifiers.taskset {ts!r}: {str(err).splitlines()[0]}") from None
    try:
        env = vf.load_environment(vf.resolve_env_config(seated(data)))
    except Exception as err:  # noqa: BLE001 - verifiers' own validation: one line
        raise Refused(f"rollout.agent.verifiers: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    if not isinstance(env, vf.SingleAgentEnv):  # its run() may play several agents or attempts: one row holds one trace
        raise Refused(f"rollout.agent.verifiers.env {data['id'] or cfg['taskset']!r}: {type(env).__name__} is not verifiers' "
                      "SingleAgentEnv; an Env that may give several traces per episode is not supported yet")
    return env


def nth_task(env, i: int):
    tasks = list(env.taskset.skip(i).take(1))
    if not tasks:
        raise Refused(f"task {TASK_COLUMN}={i}: the taskset has no such task")
    return tasks[0]


def reward_weights(env) -> dict[str, float]:
    task = nth_task(env, 0)
    out = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
    out.update({j.reward_name: float(j.config.weight) for j in task.plugged_judges()})
    return dict(sorted(out.items()))


def _message(m) -> dict:
    d = m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    return {k: v for k, v in sorted(d.items()) if k not in ("id", "timestamp", "created")}


def canonical(episode) -> dict:
    """The episode's one trace, canonical: what it means, never when or under which id."""
    traces = list(episode.traces)
    errors = [{"type": e.type, "message": e.message} for e in episode.errors]
    out = {"task": {"key": episode.task.key, "hash": episode.task.hash}, "ok": episode.ok, "is_timeout": episode.is_timeout,
           "episode_errors": errors, "traces": len(traces)}
    if len(traces) != 1:
        return {**out, "trace": None}
    t = traces[0]
    rewards = {k: None if r is None else {"score": r.score, "weight": r.weight} for k, r in sorted(t.rewards.items())}
    out["trace"] = {
        "messages": [_message(m) for m in t.messages], "rewards": rewards, "reward": t.reward,
        "metrics": dict(sorted(t.metrics.items())), "stop_condition": t.stop_condition, "ok": t.ok,
        "is_timeout": t.is_timeout, "is_completed": t.is_completed,
        "errors": [{"type": e.type, "message": e.message} for e in t.errors], "branches": t.num_branches,
    }
    branch = t.branches[-1] if t.branches else None  # the train client's own ids of each sampled node (none on eval)
    sampled = [[i for i, m in zip(n.token_ids, n.mask) if m] for n in (branch.nodes if branch else []) if n.sampled]
    if any(sampled):
        out["trace"]["sampled_ids"] = sampled
    return out


def client_config(cfg: dict):
    """verifiers' client for grpo's endpoint: eval (the chat route) or train (the tokens route, its
    renderer built for the tokenizer grpo samples with, GRPO_TOKENIZER)."""
    from verifiers.v1.clients import EvalClientConfig, TrainClientConfig

    if cfg.get("client", "eval") == "eval":
        return EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY")
    return TrainClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY",
                             renderer_model_name=os.environ["GRPO_TOKENIZER"], renderer=cfg.get("renderer"))


def tools_of(env, cfg: dict) -> list[str]:
    """What gives the episode's agent tools: a harness other than `null` (bash's shell, ...), the
    taskset's or its tasks' toolsets."""
    ts = env.taskset
    out = [f"harness {cfg.get('harness')!r}"] if cfg.get("harness") != "null" else []
    if type(ts).toolsets(ts.config) or ts.task_type().toolsets(nth_task(env, 0).config):
        out.append(f"taskset {cfg['taskset']!r}'s toolsets")
    return out


def check_renderer(env, cfg: dict) -> None:
    """Refused when the tokens route (client train) would give tools to a renderer that parses no tool calls."""
    if cfg.get("client", "eval") != "train":
        return
    if not os.environ.get("GRPO_TOKENIZER"):
        raise Refused("rollout.agent.verifiers.client train: no tokenizer to build verifiers' renderer for (GRPO_TOKENIZER)")
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from verifiers.v1.clients import TrainClientConfig

    try:
        tok = load_tokenizer(os.environ["GRPO_TOKENIZER"])
        renderer = create_renderer(tok, TrainClientConfig(renderer=cfg.get("renderer")).renderer)
    except Exception as err:  # noqa: BLE001 - the renderers package's own validation: one line
        raise Refused(f"rollout.agent.verifiers.renderer: {type(err).__name__}: {' '.join(str(err).splitlines()[:3])}") from None
    if (tools := tools_of(env, cfg)) and not getattr(renderer, "supports_tools", True):
        raise Refused(f"rollout.agent.verifiers.client train: the episode has tools ({', '.join(tools)}) and the renderer "
                      f"{type(renderer).__name__} parses no tool calls; set rollout.agent.verifiers.renderer to one with a "
                      "tool parser (e.g. {name: default, tool_parser: qwen3}: Hermes-style <tool_call> JSON) or use client eval")
    probe = {"name": "grpo_probe_tool", "description": "a probe", "parameters": {"type": "object", "properties": {}}}
    if tools and probe["name"] not in tok.decode(renderer.render_ids([{"role": "user", "content": "hi"}], tools=[probe],
                                                                     add_generation_prompt=True)):  # the template drops them
        raise Refused(f"rollout.agent.verifiers.client train: the episode has tools ({', '.join(tools)}) and the renderer "
                      f"{type(renderer).__name__} renders no tool schemas for {os.environ['GRPO_TOKENIZER']!r} (its chat "
                      "template has no tools): the model would never see them; use a renderer for a template with tools or client eval")


async def episode(cfg: dict, task_row: dict) -> dict:
    from verifiers.v1.clients import ModelContext

    env = load(cfg)
    if TASK_COLUMN not in task_row:
        raise Refused(f"the task row has no {TASK_COLUMN!r} column (the taskset's index of its task)")
    task = nth_task(env, int(task_row[TASK_COLUMN]))
    client = client_config(cfg)
    ctx = ModelContext(client=client, model=os.environ["GRPO_MODEL"], sampling=None)
    async with env.serving():
        ep = await env.run_episode(task, ctx)
    rec = canonical(ep)
    t = rec["trace"]
    metrics = {} if t is None else {k: v for k, v in t["metrics"].items()}
    return {"reward": None if t is None else t["reward"], "metrics": metrics, "verifiers": rec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="rollout.agent.verifiers as JSON")
    p.add_argument("--check", action="store_true")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--score", action="store_true", help="re-score recorded traces (stdin) with no runtime: vf_score.py")
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    # verifiers' harnesses look for `uv` on PATH: the one beside this interpreter first (the extra installs the uv wheel)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    try:
        if a.check:
            env = load(cfg)
            check_renderer(env, cfg)
            print(json.dumps({"rewards": reward_weights(env)}, sort_keys=True))
            return 0
        if a.score:
            import vf_score  # the sibling module: this file's folder is sys.path[0]

            return vf_score.main(cfg, load, nth_task)
        if a.rows is not None:
            env = load(cfg)
            for i, task in enumerate(env.taskset.take(a.rows)):
                print(json.dumps({"prompt": task.data.prompt, TASK_COLUMN: i}, sort_keys=True, default=str))
            return 0
        result = asyncio.run(episode(cfg, json.loads(os.environ["GRPO_TASK"])))
    except Refused as err:
        print(f"grpo: {err}", file=sys.stderr)
        return 2
    with open(os.environ["GRPO_RESULT_FILE"], "w") as f:
        json.dump(result, f, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
