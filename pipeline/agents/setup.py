"""Loading what an agentic rollout needs, once per stage (and at `grpo init`, where each failure
is one line and no run directory is made): the tools and their schemas, the environment class,
the tool format for the model's chat template, and the end-of-turn token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.agents import environment as envs
from pipeline.agents.format import ToolFormat, choose
from pipeline.agents.tools import load_tools, tool_schema
from pipeline.errors import GRPOError


@dataclass
class Agents:
    tools: dict[str, Callable]
    schemas: list[dict]
    env_cls: type | None
    format: ToolFormat
    note: str | None
    eos_ids: list[int]


def eos_ids(model_dir: Path, tokenizer) -> list[int]:
    """The ids that end a model turn: generation_config's eos_token_id(s) and the tokenizer's."""
    import json

    ids = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def load_agents(rollout, tokenizer, model_dir: Path, model_label: str) -> Agents:
    fns = load_tools(rollout.tools, rollout.tool_timeout_s)
    tools = {f.__name__: f for f in fns}
    schemas = [tool_schema(f, f"rollout.tools {f.__name__!r}") for f in fns]
    env_cls = envs.load_environment(rollout.environment) if rollout.environment else None
    fmt, note = choose(tokenizer, rollout.tool_format, model_label)
    return Agents(tools, schemas, env_cls, fmt, note, eos_ids(model_dir, tokenizer))


def check(cfg) -> str | None:
    """`grpo init`'s checks of rollout.tools / rollout.environment; returns the format note, if any."""
    from transformers import AutoTokenizer

    from pipeline.store.run import model_source

    model_dir, _ = model_source(cfg.model, "model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:
        raise GRPOError(f"model {cfg.model}: cannot load its tokenizer ({type(err).__name__})") from None
    agents = load_agents(cfg.rollout, tokenizer, model_dir, cfg.model)
    if agents.env_cls is not None:  # its methods must be tools too: build one, as TRL probes one
        instance = envs.make(agents.env_cls)
        for m in envs.methods(instance):
            if m.__name__ in agents.tools:
                raise GRPOError(f"rollout.environment: method {m.__name__!r} has the name of a tool in rollout.tools")
            tool_schema(m, f"rollout.environment method {m.__name__!r}")
    return agents.note
