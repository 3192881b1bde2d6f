"""The benchmark's workloads and the assets they share (demo data, tiny and small models).

Every workload is the demo task with G=8, 16 prompts per iteration and up to 64 new tokens;
they differ in model size and update epochs. The run config starts from the shipped demo
config (demo/configs/demo.yaml) for data and rewards, with evaluation off (TRL's loop has
no periodic eval) and MLflow on (its cost is part of what is measured). Everything that sets
the amount of work (sampling, loss, optimizer) is pinned here, so a change to the demo's
defaults cannot change what the bench compares; TRL and the bare engines read the same values.
The loss has no KL term (TRL's beta 0): no reference model on either side.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "work"
DEMO_CONFIG = ROOT.parent / "demo" / "configs" / "demo.yaml"

SFT_STEPS = {"tiny": 150, "small": 40}
"""Warm-start steps per size (the demo uses 500 for tiny): enough that completions stop at EOS,
which is what the timings need; fewer for small (5x the cost per step) to fit the time budget."""
N_TRAIN, N_EVAL = 4000, 32
"""Demo data: the demo's training set; a short eval set (only make-model's accuracy uses it)."""


@dataclass(frozen=True)
class Workload:
    size: str
    epochs: int
    iters: int
    """`grpo iterate` iterations; the first is the warm-up and is not counted."""
    commands: int
    """Further iterations run as the four separate commands (one process each)."""
    trl_steps: int
    """TRL generation cycles (one cycle = one of our iterations); the first is not counted."""
    profile: bool = False
    """Run one more `grpo iterate` iteration under cProfile (not counted in the timings)."""
    num_generations: int = 8
    prompts_per_iter: int = 16
    max_new_tokens: int = 64
    mini_batch_size: int = 64
    lr: float = 1e-4
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.size}-e{self.epochs}"

    def as_dict(self) -> dict:
        return asdict(self) | {"name": self.name}


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("tiny", 1, iters=2, commands=1, trl_steps=2, profile=True)]
    return [
        # `make bench` from a fresh clone (install ~4.5 min) must stay under 20 minutes: two
        # measured iterations at tiny, one at small; the separate commands at tiny only (at small
        # they cost the same +55-65 s of imports and exits, measured 2026-11-22).
        Workload("tiny", 1, iters=3, commands=1, trl_steps=3, profile=True),
        Workload("tiny", 2, iters=2, commands=0, trl_steps=2),
        Workload("small", 1, iters=2, commands=0, trl_steps=2, profile=True),
        Workload("small", 2, iters=2, commands=0, trl_steps=2),  # the longest: one measured iteration each
    ]


def data_dir() -> Path:
    return WORK / "data"


def model_dir(size: str) -> Path:
    return WORK / "models" / size


def build_assets(sizes: list[str]) -> dict:
    """Demo data and the warm-started models, with the project's own builders (kept between
    runs: make_model skips a directory that already holds the same settings)."""
    from demo.task import write_demo_data
    from demo.tinymodel import make_model

    write_demo_data(data_dir(), n_train=N_TRAIN, n_eval=N_EVAL, seed=0)
    records = {}
    for size in sizes:
        records[size] = make_model(model_dir(size), size=size, seed=0, data_dir=data_dir(), sft_steps=SFT_STEPS[size])
    return records


def config_tree(w: Workload) -> dict:
    """The run config: the demo's, with this workload's sizes."""
    from demo.task import SYSTEM_PROMPT

    tree = yaml.safe_load(DEMO_CONFIG.read_text())
    tree["model"] = str(model_dir(w.size))
    tree["data"].update(train=str(data_dir() / "train.jsonl"), eval=None, system_prompt=SYSTEM_PROMPT)
    tree["rollout"] = {
        "engine": "vllm", "num_generations": w.num_generations, "prompts_per_iter": w.prompts_per_iter,
        "groups_per_part": w.prompts_per_iter, "max_new_tokens": w.max_new_tokens, "temperature": 1.0,
    }
    tree["advantages"] = {"scale": "group", "std": "sample"}
    tree["loss"] = {"type": "dapo", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.0}
    tree["train"] = {"epochs": w.epochs, "mini_batch_size": w.mini_batch_size, "lr": w.lr, "zero_stage": 0}
    tree["eval"] = {"every": 0}
    tree["seed"] = w.seed
    tree["tracking"] = {"mlflow": True}
    return tree


def resolved_config(w: Workload):
    """The validated run config; the comparisons assume no reference model."""
    from pipeline import config as config_mod

    cfg = config_mod.resolve(config_tree(w), source=f"bench workload {w.name}")
    assert not cfg.uses_ref, "bench workloads compare without a reference model (TRL beta 0)"
    return cfg


def load_workload(text: str) -> Workload:
    d = json.loads(text)
    d.pop("name", None)
    return Workload(**d)
