"""What a config means per iteration, derived without running anything: `grpo init` prints it,
as nanoGPT prints its tokens per iteration, so a user can check the arithmetic before a rollout.

    completions      = prompts_per_iter x num_generations
    optimizer steps  = epochs x ceil(completions / mini_batch_size)
    micro-batch      = mini_batch_size / grad_accum / processes (per rank)

`iteration_plan` and `steps_per_iter` (pipeline/schedule.py: what iteration k does, which policy samples it, where its old logprobs come
from, whether a reference pass runs) are the ones the stages use, so the
plan cannot say something the run then does differently. Nothing here imports torch: `init` stays fast.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeline.config import Config
from pipeline.run.policy import policy_kind
from pipeline.schedule import iteration_plan, steps_per_iter


def machine_precision(precision: str) -> str:
    """`train.precision` as `pipeline.models.tokens.resolve_precision` resolves it on this machine,
    read from /proc/cpuinfo where no NVIDIA driver is loaded (torch's CPU check asks CPUID for
    the same two features); with a GPU, or without /proc/cpuinfo, torch itself is asked."""
    if precision != "auto":
        return precision
    if not os.path.exists("/proc/driver/nvidia") and os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        return "bf16" if {"avx512_bf16", "amx_tile"} & set(flags) else "fp32"
    from pipeline.models.tokens import resolve_precision  # imports torch

    return resolve_precision(precision)


@dataclass(frozen=True)
class Preview:
    """One iteration of a run, derived from its config."""

    prompts: int
    generations: int
    completions: int  # prompts x generations
    max_new_tokens: int  # completions x rollout.max_new_tokens: the most a rollout samples
    epochs: int
    mini_batch: int
    steps: int  # optimizer steps per iteration
    total_steps: int  # over train.total_iters: the LR schedule's horizon
    total_iters: int
    grad_accum: int
    world: int
    micro_batch: float  # completions per rank per forward/backward
    precision: str  # train.precision as resolved
    precision_auto: bool
    engine: str
    engine_dtype: str
    old_logprobs: str
    old_logprobs_iter0: str | None  # where iteration 0 differs
    reference: str | None  # None: no reference pass
    training: str

    def lines(self) -> list[str]:
        """The plan as a few aligned `name  value` lines."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs > 1 else ''}"
        processes = f"{self.world} process{'es' if self.world > 1 else ''}"
        auto = " (auto, on this machine)" if self.precision_auto else ""
        iter0 = f"; iteration 0: {self.old_logprobs_iter0}" if self.old_logprobs_iter0 else ""
        rows = [
            ("completions", (f"{self.completions} per iteration = {self.prompts} prompts x {self.generations} generations"
                             f" (at most {self.max_new_tokens:,} new tokens)")),
            ("optimizer steps", (f"{self.steps} per iteration = {epochs} x ceil({self.completions} / {self.mini_batch});"
                                 f" {self.total_steps:,} over train.total_iters {self.total_iters}")),
            ("micro-batch", f"{self.micro_batch:g} completions per rank = {self.mini_batch} / grad_accum {self.grad_accum} / {processes}"),
            ("precision", f"{self.precision}{auto}; engine {self.engine} in {self.engine_dtype}"),
            ("old logprobs", self.old_logprobs + iter0),
            ("reference pass", self.reference or "none (loss.kl_coef 0, no KL in the reward)"),
            ("training", self.training),
        ]
        width = max(len(name) for name, _ in rows)
        return [f"  {name:<{width}}  {value}" for name, value in rows]


def preview(cfg: Config, precision: str, world: int = 1) -> Preview:
    """The plan of `cfg` with `train.precision` resolved to `precision` (`machine_precision`)
    and the update on `world` processes."""
    # a light module: torch loads only to resolve an `auto` precision, which is resolved here
    from pipeline.models.engines import engine_dtype

    r, t = cfg.rollout, cfg.train
    completions = r.prompts_per_iter * r.num_generations
    steps = steps_per_iter(cfg)
    return Preview(
        prompts=r.prompts_per_iter, generations=r.num_generations, completions=completions,
        max_new_tokens=completions * r.max_new_tokens, epochs=t.epochs, mini_batch=t.mini_batch_size,
        steps=steps, total_steps=steps * t.total_iters, total_iters=t.total_iters, grad_accum=t.grad_accum,
        world=world, micro_batch=t.mini_batch_size / t.grad_accum / world,
        precision=precision, precision_auto=t.precision == "auto",
        engine=r.engine, engine_dtype=engine_dtype(r.dtype, precision),
        old_logprobs=_old_logprobs(cfg, 1), old_logprobs_iter0=_iter0(cfg),
        reference=_reference(cfg), training=_training(cfg),
    )


def _old_logprobs(cfg: Config, k: int) -> str:
    """Where iteration k's old-policy logprobs come from, and why."""
    it = iteration_plan(cfg, k)
    if it.ref_is_old:
        return "the reference pass (same weights as the old policy)"
    if it.old_from_update:
        return "the update's own forward (one optimizer step per epoch)"
    t = cfg.train
    if t.old_logprobs == "pass":
        why = "train.old_logprobs pass"
    elif cfg.rollout.prompts_per_iter * cfg.rollout.num_generations > t.mini_batch_size:
        why = f"{math.ceil(cfg.rollout.prompts_per_iter * cfg.rollout.num_generations / t.mini_batch_size)} optimizer steps per epoch"
    elif (random := _policy(cfg).random_forward()) is not None:
        why = random
    else:
        why = "KL in the reward"
    return f"logprobs stage pass ({why})"


def _iter0(cfg: Config) -> str | None:
    first = _old_logprobs(cfg, 0)
    return first if first != _old_logprobs(cfg, 1) else None


def _reference(cfg: Config) -> str | None:
    if not iteration_plan(cfg, 1).reference:
        return None
    why = [f"loss.kl_coef {cfg.loss.kl_coef:g}"] if cfg.loss.kl_coef > 0 else []
    if cfg.advantages.kl_in_reward.coef > 0:
        why.append(f"advantages.kl_in_reward.coef {cfg.advantages.kl_in_reward.coef:g}")
    if cfg.ref_model is not None:
        ref = cfg.ref_model
    else:
        ref = _policy(cfg).reference_line()
    return f"every iteration, on {ref} ({', '.join(why)})"


def _training(cfg: Config) -> str:
    return _policy(cfg).training_line()


def _policy(cfg: Config):
    return policy_kind(cfg)
