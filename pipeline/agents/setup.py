"""Loading what an agentic rollout needs, once per stage (and at `grpo init`, where each failure
is one line and no run directory is made): the tools and their schemas, the environment class,
the tool format for the model's chat template, and the ids that end a turn."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.agents import environment as envs
from pipeline.agents.format import ToolFormat
from pipeline.agents.probe import choose
from pipeline.agents.tools import load_tools, tool_schema
from pipeline.errors import GRPOError
from pipeline.models.stop_tokens import stop_token_ids


@dataclass
class Agents:
    tools: dict[str, Callable]
    schemas: list[dict]
    env_classes: dict[str | None, type]
    """{None: class} for one environment, {name: class} for a mapping; {} without one."""
    format: ToolFormat
    note: str | None
    stop_ids: list[int]
    """The ids that end a model turn (pipeline/models/stop_tokens.py): the ones the engine stops on."""

    @property
    def env_cls(self) -> type | None:
        """The single environment's class (None without one, or with a mapping)."""
        return self.env_classes.get(None)


def load_agents(rollout, tokenizer, model_dir: Path, model_label: str) -> Agents:
    fns = load_tools(rollout.tools, rollout.tool_timeout_s)
    tools = {f.__name__: f for f in fns}
    schemas = [tool_schema(f, f"rollout.tools {f.__name__!r}") for f in fns]
    env_classes = envs.load_environments(rollout.environment)
    fmt, note = choose(tokenizer, rollout.tool_format, model_label)
    return Agents(tools, schemas, env_classes, fmt, note, stop_token_ids(model_dir, tokenizer))


def check(cfg) -> str | None:
    """`grpo init`'s checks of rollout.tools / rollout.environment; returns the format note, if any."""
    from transformers import AutoTokenizer

    from pipeline.run.run import model_source

    if cfg.rollout.agent is not None:  # its program and the scripts it names exist
        from pipeline.agents.endpoint.process import check_command
        from pipeline.agents.endpoint.vf_run import agent_argv

        check_command(agent_argv(cfg.rollout.agent))
    model_dir, _ = model_source(cfg.model, "model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:
        raise GRPOError(f"model {cfg.model}: cannot load its tokenizer ({type(err).__name__})") from None
    agents = load_agents(cfg.rollout, tokenizer, model_dir, cfg.model)
    for name, cls in agents.env_classes.items():  # its methods must be tools too: build one, as TRL probes one
        label = f"rollout.environment{'.' + name if name else ''}"
        instance = envs.make(cls, label)
        for m in envs.methods(instance):
            if m.__name__ in agents.tools:
                raise GRPOError(f"{label}: method {m.__name__!r} of {cls.__name__} has the name of a tool in rollout.tools "
                                "(a row is offered both)")
            tool_schema(m, f"{label} method {m.__name__!r}")
    if None not in agents.env_classes and agents.env_classes:
        check_routes(cfg, agents.env_classes)
    return agents.note


def check_routes(cfg, classes: dict) -> None:
    """Every row of data.train (and data.eval) names one of the mapping's environments in its `environment` column."""
    from pipeline.data.prompts import load_dataset_frame

    sets = [("data.eval" if s.name is None else f"data.eval.{s.name}", s.path) for s in cfg.eval_sets()]
    for key, path in (("data.train", cfg.data.train), *sets):
        df = load_dataset_frame(path)
        if envs.ROUTE_COLUMN not in df.columns:
            raise GRPOError(f"{key} {path}: no column {envs.ROUTE_COLUMN!r}; rollout.environment is a mapping, so each row "
                            f"names its environment there ({', '.join(sorted(classes))})")
        for row, name in enumerate(df.get_column(envs.ROUTE_COLUMN).to_list()):
            if name not in classes:
                raise GRPOError(f"{key} {path} row {row}: column {envs.ROUTE_COLUMN!r} is {name!r}, not one of "
                                f"rollout.environment's names ({', '.join(sorted(classes))})")


def with_environment_rewards(cfg):
    """The config with TRL's implicit reward sources written out: each environment class that
    defines get_reward, named after the class, weight 1, and with rollout.agent the reward `agent`
    (the agent's result file, pipeline.agents.endpoint.result), or with rollout.agent.verifiers one
    reward `vf_<name>` per reward of the taskset (its verifiers weight), unless `rewards` names them already.
    A run with no reward function and no get_reward is refused here (before a run directory exists)."""
    from pipeline import config as config_mod

    from pipeline.agents.endpoint.result import reward_spec

    have = {r.column for r in cfg.rewards}
    agent = cfg.rollout.agent
    if agent is not None and agent.verifiers is not None:  # the trace's rewards, as verifiers weighs them (endpoint/vf_run.py)
        from pipeline.agents.endpoint.vf_run import reward_specs as vf_specs

        # and the reward `agent` at weight 0: Trace.reward logged as reward_agent, the trace's metrics as extra_agent_<name>
        agent_specs = vf_specs(agent.verifiers, cfg.model) + [{**reward_spec(), "weight": 0.0}]
    else:
        agent_specs = [reward_spec()] if agent is not None else []
    specs = envs.reward_specs(cfg.rollout.environment) + agent_specs
    extra = [spec for spec in specs if spec["name"] not in have]
    if not cfg.rewards and not extra:
        raise GRPOError("rewards: none given, and no rollout.environment class defines get_reward; TRL needs reward "
                        "functions or an environment that scores itself")
    if not extra:
        return cfg
    tree = cfg.model_dump(mode="json")
    tree["rewards"] = tree["rewards"] + extra
    return config_mod.resolve(tree)
