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
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "work"
AGENT_MODEL_DIR = WORK / "models" / "agent"
"""bench/agent.py's model: the demo-agent run's policy, exported (bench.agent.model_dir)."""
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
    lora: bool = False
    """real-* only: LoRA r=16 (`train.lora`) instead of full fine-tuning."""
    temperature: float = 1.0
    engine: str = "vllm"
    """rollout.engine: hf is grpo's transformers-`generate` engine, TRL's generation on the same rows (issue 61)."""
    trl_micro_batch: int | None = None
    """TRL's per-device micro-batch (gradient accumulation over the mini-batch); None = the
    whole mini-batch, except real-*: 16, since TRL with all 64 sequences in one micro-batch needs
    more than this 24 GB machine has (issue 17)."""

    def __post_init__(self):
        if self.trl_micro_batch is None and self.size == "real":
            object.__setattr__(self, "trl_micro_batch", 16)

    @property
    def name(self) -> str:
        if self.size == "agent":  # bench/agent.py's one workload
            return "agent-lora"
        if self.size == "real":  # real-full, real-lora, real-lora-e2 (issue 17's names)
            kind = "lora" if self.lora else "full"
            tail = (f"-e{self.epochs}" if self.epochs > 1 else "") + ("-hf" if self.engine == "hf" else "")
            return f"real-{kind}" + tail + (f"-t{self.max_new_tokens}" if self.max_new_tokens != 128 else "")
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
        *real_workloads(),
    ]


LORA = {"r": 16, "alpha": 32}
"""real-lora's adapter (issue 17): r=16 on all linear projections (train.lora's default targets)."""


def real_workloads() -> list[Workload]:
    """Generation-heavy work on a real pretrained model (SmolLM2-135M-Instruct, bench/real.py):
    GSM8K-style chat prompts, 8 prompts x G=8, up to 128 new tokens, temperature 1.0, one
    optimizer step per iteration (mini-batch 64), lr 1e-5. TRL runs each at bf16 False and True."""
    common = dict(iters=2, trl_steps=2, num_generations=8, prompts_per_iter=8, max_new_tokens=128, mini_batch_size=64, lr=1e-5)
    return [
        Workload("real", 1, commands=1, profile=True, **common),
        Workload("real", 1, commands=0, lora=True, **common),
        Workload("real", 2, commands=0, lora=True, **common),  # 2 epochs: the old logprobs are really needed
    ]


def hf_workloads() -> list[Workload]:
    """real-full on grpo's HF engine (`rollout.engine: hf`), the CPU stand-in for the GPU claim against
    TRL's `generate` (issue 61; bench/hf_engine.py, `make bench-hf`, not `make bench`): the same rows as
    real-full, and a longer completion budget."""
    common = dict(iters=2, trl_steps=2, num_generations=8, prompts_per_iter=8, mini_batch_size=64, lr=1e-5, engine="hf", commands=0)
    return [Workload("real", 1, max_new_tokens=128, **common), Workload("real", 1, max_new_tokens=512, **common)]


def data_dir(size: str = "tiny") -> Path:
    return WORK / {"real": "data-real", "agent": "data-agent"}.get(size, "data")


def model_dir(size: str) -> Path:
    if size == "agent":
        return AGENT_MODEL_DIR
    if size == "real":
        from bench.real import model_dir as real_model_dir

        return real_model_dir()
    return WORK / "models" / size


def train_path(size: str) -> Path:
    return data_dir(size) / ("gsm8k_style.jsonl" if size == "real" else "train.jsonl")


AGENT_CONFIG = ROOT.parent / "examples" / "agent.yaml"


def agent_tree(w: Workload) -> dict:
    """The agent workload's run config: the agent demo's (examples/agent.yaml: tool, reward,
    loss, LoRA), with this workload's sizes, the tool and reward files named absolutely, the
    turn budget TRL has (each turn may use what is left of the episode's), eval off."""
    tree = yaml.safe_load(AGENT_CONFIG.read_text())
    repo = ROOT.parent
    tree["model"] = str(model_dir("agent"))
    tree["data"].update(train=str(train_path("agent")), eval=None)
    tree["rollout"].update(num_generations=w.num_generations, prompts_per_iter=w.prompts_per_iter, groups_per_part=w.prompts_per_iter,
                           max_new_tokens=w.max_new_tokens, max_episode_tokens=w.max_new_tokens, temperature=w.temperature,
                           tools=[str(repo / t) for t in tree["rollout"]["tools"]])
    tree["rewards"] = [{**r, "fn": str(repo / r["fn"])} for r in tree["rewards"]]
    tree["loss"] = {"type": "dapo", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.0}
    tree["train"].update(epochs=w.epochs, mini_batch_size=w.mini_batch_size, lr=w.lr, lora=dict(LORA), zero_stage=0)
    tree["eval"] = {"every": 0}
    tree["seed"] = w.seed
    return tree


def build_assets(sizes: list[str]) -> dict:
    """Demo data and the warm-started models, with the project's own builders (kept between
    runs: make_model skips a directory that already holds the same settings)."""
    from demo.task import write_demo_data
    from demo.tinymodel import make_model

    write_demo_data(data_dir(), n_train=N_TRAIN, n_eval=N_EVAL, seed=0)
    records = {}
    for size in sizes:
        if size == "real":  # a pretrained model: no warm start; only the prompts are generated here
            from bench.real import write_data

            write_data(data_dir("real"))
            records[size] = {"model": str(model_dir("real"))}
            continue
        records[size] = make_model(model_dir(size), size=size, seed=0, data_dir=data_dir(), sft_steps=SFT_STEPS[size])
    return records


def config_tree(w: Workload) -> dict:
    """The run config: the demo's, with this workload's sizes (the agent demo's for the agent workload)."""
    from demo.task import SYSTEM_PROMPT

    if w.size == "agent":
        return agent_tree(w)
    tree = yaml.safe_load(DEMO_CONFIG.read_text())
    tree["model"] = str(model_dir(w.size))
    tree["data"].update(train=str(train_path(w.size)), eval=None, system_prompt=SYSTEM_PROMPT)
    tree["rollout"] = {
        "engine": w.engine, "num_generations": w.num_generations, "prompts_per_iter": w.prompts_per_iter,
        "groups_per_part": w.prompts_per_iter, "max_new_tokens": w.max_new_tokens, "temperature": w.temperature,
    }
    tree["advantages"] = {"scale": "group", "std": "sample"}
    tree["loss"] = {"type": "dapo", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.0}
    tree["train"] = {"epochs": w.epochs, "mini_batch_size": w.mini_batch_size, "lr": w.lr, "zero_stage": 0}
    if w.lora:  # `train.lora` arrives with the LoRA branch (issue 15); until then this workload fails validation
        tree["train"]["lora"] = dict(LORA)
    tree["eval"] = {"every": 0}
    tree["seed"] = w.seed
    tree["tracking"] = {"mlflow": True}
    return tree


def resolved_config(w: Workload):
    """The validated run config; the comparisons assume no reference model."""
    from pipeline import config as config_mod
    from pipeline.schedule import uses_ref

    cfg = config_mod.resolve(config_tree(w), source=f"bench workload {w.name}")
    assert not uses_ref(cfg), "bench workloads compare without a reference model (TRL beta 0)"
    return cfg


def load_workload(text: str) -> Workload:
    d = json.loads(text)
    d.pop("name", None)
    return Workload(**d)


def worker_env(threads: int | None) -> dict:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # each run logs to its own embedded store
    env["GRPO_CACHE_DIR"] = str(WORK / "cache")
    # DeepSpeed JIT-builds its shm op into ~/.cache/torch_extensions, shared by every Python
    # environment of the user: two environments rebuild it in turn (60-170 s each time on a busy
    # 2-core machine). A private directory builds it once per bench/work.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(WORK / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env
