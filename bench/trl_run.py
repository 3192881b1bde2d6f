"""Worker: TRL's GRPOTrainer on the same workload, for seconds per iteration and reward.

    python -m bench.trl_run WORKLOAD_JSON OUT_JSON

The same model, prompts (chat-rendered with the same system prompt), rewards (the run's own
reward functions, which follow TRL's contract) and weights, G, completions per generation,
max new tokens, epochs over each generation (num_iterations), mini-batch, optimizer and loss
(DAPO token normalisation, clip 0.2 / 0.28, beta 0 so no reference model). Generation is HF
`generate` (use_vllm=False: TRL's vLLM modes expect a GPU). TRL's defaults that would make it
do different work are turned off: gradient checkpointing, and bf16 unless BENCH_TRL_PRECISION=bf16
(where the CPU computes in bf16 the bench runs TRL both ways and counts the faster). LoRA workloads give TRL the same
adapter as `peft_config`.

One of our iterations is one TRL generation cycle: `steps_per_generation` optimizer steps per
pass over the generation batch, times `num_iterations` passes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from bench.probes import loadavg, machine_info, peak_rss_mb
from bench.workloads import WORK, load_workload, resolved_config


def trl_reward(spec, calls: list | None = None):
    """The run's reward function `spec`, loaded as the run loads it, named as TRL logs it;
    with `calls`, each call's values are appended there."""
    from pipeline.rewards.contract import load_reward

    fn = load_reward(spec)

    def reward(prompts, completions, **kwargs):
        values = fn(prompts, completions, **kwargs)
        if calls is not None:
            calls.append({"name": spec.column, "values": values})
        return values

    reward.__name__ = spec.column
    return reward


def main(workload_json: str, out: str) -> None:
    from pipeline.models.engines import cpu_env

    cpu_env()
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    w = load_workload(workload_json)
    cfg = resolved_config(w)  # the run's config: TRL gets the same numbers
    dataset = trl_dataset(cfg)
    weights = {spec.column: spec.weight for spec in cfg.rewards}
    calls: list[dict] = []

    per_cycle = cycle_steps(cfg)
    args = trl_args(cfg, WORK / "trl" / f"{w.name}", max_steps=w.trl_steps * per_cycle,
                    bf16=os.environ.get("BENCH_TRL_PRECISION", "fp32") == "bf16", micro_batch=w.trl_micro_batch)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[trl_reward(spec, calls) for spec in cfg.rewards], args=args,
        train_dataset=dataset, processing_class=tokenizer, peft_config=trl_peft(cfg), tools=trl_tools(cfg),
    )
    setup_s = time.perf_counter() - t_load

    step_end: list[float] = []
    step_cpu: list[float] = []  # process CPU seconds: less sensitive than wall to a shared machine's load
    gen: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            step_end.append(time.perf_counter())
            step_cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kw):
            step_end.append(time.perf_counter())
            step_cpu.append(time.process_time())

    trainer.add_callback(Clock())
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):  # generation + old logprobs + rewards, once per cycle
        t, c = time.perf_counter(), time.process_time()
        out = generate(*a, **kw)
        gen.append({"seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c, "tokens": int(out["completion_mask"].sum())})
        return out

    if cfg.rollout.tools:  # the agent workload: turns and tool calls per episode, from TRL's own loop
        tool_loop = trainer._tool_call_loop

        def counted_tool_loop(prompts, prompt_ids, completion_ids, completions, *a, **kw):
            out = tool_loop(prompts, prompt_ids, completion_ids, completions, *a, **kw)
            episodes = out[1]  # (tool_mask, completions, ...): each completion a list of messages
            calls = [sum(m["role"] == "tool" for m in c) for c in episodes]
            turns = [sum(m["role"] == "assistant" for m in c) for c in episodes]
            shapes.append({"turns_mean": sum(turns) / len(turns), "calls_mean": sum(calls) / len(calls)})
            return out

        trainer._tool_call_loop = counted_tool_loop
    shapes: list[dict] = []

    trainer._generate_and_score_completions = timed_generate
    info = machine_info()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0

    cycles = []
    for c in range(w.trl_steps):
        seconds = step_end[(c + 1) * per_cycle] - step_end[c * per_cycle]
        n_fn = len(cfg.rewards)
        group = calls[n_fn * c : n_fn * (c + 1)]  # one call per reward function per generation
        per_fn = {x["name"]: np.array([np.nan if v is None else v for v in x["values"]], dtype=float) for x in group}
        total = np.nansum(np.stack([weights[n] * per_fn[n] for n in per_fn]), axis=0)
        cycles.append(
            {
                "cycle": c,
                "seconds": seconds,
                "cpu_s": step_cpu[(c + 1) * per_cycle] - step_cpu[c * per_cycle],
                "generate_s": gen[c]["seconds"] if c < len(gen) else math.nan,
                "generate_cpu_s": gen[c]["cpu_s"] if c < len(gen) else math.nan,
                "tokens": gen[c]["tokens"] if c < len(gen) else 0,
                "reward/mean": float(total.mean()),
                "accuracy": float(np.nanmean(per_fn["correct"])) if "correct" in per_fn else math.nan,
                "loadavg": loadavg(),
                **(shapes[c] if c < len(shapes) else {}),
            }
        )
        print(f"[trl {w.name}] cycle {c}: {seconds:.1f}s (generate {cycles[-1]['generate_s']:.1f}s) "
              f"reward {cycles[-1]['reward/mean']:.3f}", flush=True)
    result = {
        "workload": w.as_dict(),
        "machine_start": info,
        "loadavg_end": loadavg(),
        "setup_s": setup_s,
        "wall_s": wall,
        "steps_per_cycle": per_cycle,
        "cycles": cycles,
        "generations": len(gen),
        "peak_rss_mb": peak_rss_mb(),
        "precision": os.environ.get("BENCH_TRL_PRECISION", "fp32"),
        "torch_threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(result, indent=1))


def trl_dataset(cfg):
    """data.train as TRL's conversational dataset: the system prompt, then the prompt column
    (chat turns as they are, or text as one user turn); every other column passes through."""
    from datasets import Dataset

    rows = [json.loads(line) for line in Path(cfg.data.train).read_text().splitlines() if line.strip()]
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    col = cfg.data.prompt_column

    def prompt(value):
        return system + (list(value) if isinstance(value, list) else [{"role": "user", "content": value}])

    return Dataset.from_list([{**{k: v for k, v in r.items() if k != col}, "prompt": prompt(r[col])} for r in rows])


def trl_tools(cfg) -> list | None:
    """rollout.tools as the functions TRL takes (loaded as the run loads them), None without tools."""
    if not cfg.rollout.tools:
        return None
    from pipeline.agents.tools import load_tools

    return load_tools(cfg.rollout.tools)


def cycle_steps(cfg) -> int:
    """TRL optimizer steps per generation cycle (= one of our iterations)."""
    return cfg.rollout.prompts_per_iter * cfg.rollout.num_generations // cfg.train.mini_batch_size * cfg.train.epochs


def trl_peft(cfg):
    """train.lora as PEFT's LoraConfig (the same one the pipeline trains), None without LoRA."""
    if cfg.train.lora is None:
        return None
    from pipeline.run.lora import peft_config

    return peft_config(cfg.train.lora)


def trl_args(cfg, output_dir: Path, max_steps: int, bf16: bool, micro_batch: int | None = None, use_cpu: bool = True):
    """GRPOConfig doing the run's work: G, completions per generation, tokens, sampling, epochs
    (num_iterations), mini-batch, optimizer, loss and clip, seed. The mini-batch is split into
    micro-batches of `micro_batch` sequences (default: the run's grad_accum split) with gradient
    accumulation: the same optimizer steps, in the memory TRL has (TRL holds a micro-batch's full
    logits; our update bounds its micro-batches by a token budget instead)."""
    from trl import GRPOConfig

    r, t, loss = cfg.rollout, cfg.train, cfg.loss
    micro = micro_batch or t.mini_batch_size // t.grad_accum
    if t.mini_batch_size % micro:
        raise ValueError(f"micro-batch {micro} does not divide mini_batch_size {t.mini_batch_size}")
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=t.mini_batch_size // micro,
        # one generation batch = one of our iterations (TRL's steps_per_generation counts micro-batches)
        generation_batch_size=r.prompts_per_iter * r.num_generations,
        num_generations=r.num_generations,
        max_completion_length=r.episode_tokens() if r.agentic else r.max_new_tokens,  # with tools: the whole episode's
        num_iterations=t.epochs,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        beta=loss.kl_coef,
        loss_type=loss.type,
        epsilon=loss.clip_eps_low,
        epsilon_high=loss.clip_eps_high,
        scale_rewards=cfg.advantages.scale,
        reward_weights=[spec.weight for spec in cfg.rewards],
        learning_rate=t.lr,
        lr_scheduler_type=t.lr_schedule,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        adam_epsilon=1e-8,
        max_grad_norm=t.max_grad_norm,
        max_steps=max_steps,
        gradient_checkpointing=False,
        bf16=bf16,
        fp16=False,
        use_cpu=use_cpu,
        use_vllm=False,
        seed=cfg.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        log_completions=False,
        **({"max_tool_calling_iterations": None if r.max_turns is None else r.max_turns - 1} if r.agentic else {}),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
