"""The benchmark's workloads and the assets they share (demo data, tiny and small models).

Every workload is the demo task with G=8, 16 prompts per iteration and up to 64 new tokens;
they differ in model size and update epochs. The run config starts from the shipped demo
config (pipeline/configs/demo.yaml) with evaluation off (TRL's loop has no periodic eval)
and MLflow on (its cost is part of what is measured).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "work"
DEMO_CONFIG = ROOT.parent / "pipeline" / "configs" / "demo.yaml"

SFT_STEPS = {"tiny": 150, "small": 40}
"""Warm-start steps per size: the demo's 150 for tiny; fewer for small (5x the cost per step)
so `make bench` fits its time budget. Both then stop at EOS and get some answers right."""
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
        Workload("tiny", 1, iters=3, commands=1, trl_steps=3, profile=True),
        Workload("tiny", 2, iters=3, commands=0, trl_steps=3),
        Workload("small", 1, iters=3, commands=1, trl_steps=3, profile=True),
        Workload("small", 2, iters=3, commands=0, trl_steps=3),
    ]


def data_dir() -> Path:
    return WORK / "data"


def model_dir(size: str) -> Path:
    return WORK / "models" / size


def build_assets(sizes: list[str]) -> dict:
    """Demo data and the warm-started models, with the project's own builders (kept between
    runs: make_model skips a directory that already holds the same settings)."""
    from pipeline.demo_task import write_demo_data
    from pipeline.tinymodel import make_model

    write_demo_data(data_dir(), n_train=N_TRAIN, n_eval=N_EVAL, seed=0)
    records = {}
    for size in sizes:
        records[size] = make_model(model_dir(size), size=size, seed=0, data_dir=data_dir(), sft_steps=SFT_STEPS[size])
    return records


def config_tree(w: Workload) -> dict:
    """The run config: the demo's, with this workload's sizes."""
    from pipeline.demo_task import SYSTEM_PROMPT

    tree = yaml.safe_load(DEMO_CONFIG.read_text())
    tree["model"] = str(model_dir(w.size))
    tree["data"].update(train=str(data_dir() / "train.jsonl"), eval=None, system_prompt=SYSTEM_PROMPT)
    tree["rollout"].update(
        num_generations=w.num_generations, prompts_per_iter=w.prompts_per_iter,
        groups_per_part=w.prompts_per_iter, max_new_tokens=w.max_new_tokens,
    )
    tree["train"].update(epochs=w.epochs, mini_batch_size=w.mini_batch_size, lr=w.lr)
    tree["eval"] = {"every": 0}
    tree["seed"] = w.seed
    tree["tracking"] = {"mlflow": True}
    return tree


def load_workload(text: str) -> Workload:
    d = json.loads(text)
    d.pop("name", None)
    return Workload(**d)
