"""TRL 1.16's GRPOTrainer on the GPU proof's model and work: the run's own config (G, prompts per
generation, new tokens, loss, clip, KL, optimizer, mini-batch) through bench.trl_run's mapping,
on CUDA with bf16, generating with transformers `generate`, or with `--vllm` with TRL's own vLLM
colocate mode (`use_vllm=True, vllm_mode="colocate"`: vLLM in the trainer's process, on the same GPU,
weights pushed to it in memory each step).

    python -m bench.gpu.trl_gpu RUN OUT_JSON --iters N [--vllm]

Seconds per generation cycle (one of our iterations) and torch's peak GPU memory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(run: str, out: str, iters: int, vllm: bool = False) -> None:
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from bench.trl_run import cycle_steps, trl_args, trl_dataset, trl_peft, trl_reward
    from pipeline.run.run import Run

    cfg = Run(run).cfg
    per_cycle = cycle_steps(cfg)
    cuda = torch.cuda.is_available()
    args = trl_args(cfg, Path(run).parent / "trl-out", max_steps=iters * per_cycle, bf16=True, use_cpu=not cuda)
    if vllm:  # TRL's default colocate settings (30 % of the GPU for vLLM); steps_per_generation is derived
        # again from generation_batch_size (GRPOConfig refuses both set, and its first __post_init__ set it)
        args = dataclasses.replace(args, use_vllm=True, vllm_mode="colocate", steps_per_generation=None)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward(spec) for spec in cfg.rewards], args=args,
                          train_dataset=trl_dataset(cfg), processing_class=tokenizer, peft_config=trl_peft(cfg))
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    cycles = [ends[(c + 1) * per_cycle] - ends[c * per_cycle] for c in range(iters) if (c + 1) * per_cycle < len(ends)]
    for c, s in enumerate(cycles):
        print(f"[trl] cycle {c}: {s:.1f} s", flush=True)
    Path(out).write_text(json.dumps({
        "trl": __import__("trl").__version__,
        "generation": "vllm colocate" if vllm else "hf generate",
        "wall_s": time.perf_counter() - t0,
        "cycle_s": cycles,
        "steps_per_cycle": per_cycle,
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[sys.argv.index("--iters") + 1]), vllm="--vllm" in sys.argv)
