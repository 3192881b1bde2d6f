"""TRL 1.16's GRPOTrainer on `make demo-real`'s exact work: held-out accuracy gained per minute.

    python -m bench.calibrate_real --ours runs/demo-real [--iters N] [--bf16] [--dir DIR]

The same model (SmolLM2-135M-Instruct), generated problems (same seed), prompts (system prompt
and chat turns as the run renders them), reward functions (examples/rewards.py, loaded as the
run loads them), PEFT adapter (train.lora), G, prompts per generation, new tokens, temperature,
loss (DAPO, beta 0, clip), mini-batch and accumulation, optimizer and seed as the demo run's own
config.yaml (examples/real.yaml, or the --config it was given); N generation cycles (one cycle =
one of our iterations; default: as many as the demo run did). Generation is HF `generate`
(TRL's vLLM modes want a GPU).

The clock runs from loading the model to the end of `train()`, as the demo's runs from
`grpo iterate`'s start (engines included) to its end, less its held-out evals. TRL's final
adapter is then merged and evaluated by the demo's own evaluation (`pipeline.eval.run`: the same
held-out problems and `eval:` settings, the same rewards), so both sides' held-out accuracy is one
measurement. Prints both and the ratio of held-out accuracy gained per minute (points of
accuracy per minute of training, held-out evals excluded on our side); writes
DIR/calibration.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train_trl(cfg, out: Path, cycles: int, bf16: bool) -> tuple[Path, dict]:
    """TRL on cfg's work for `cycles` generation cycles; returns the merged model dir and timings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from bench.trl_run import cycle_steps, trl_args, trl_dataset, trl_peft, trl_reward

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[trl_reward(spec) for spec in cfg.rewards], processing_class=tokenizer,
        args=trl_args(cfg, out / "trl", max_steps=cycles * cycle_steps(cfg), bf16=bf16),
        train_dataset=trl_dataset(cfg), peft_config=trl_peft(cfg),
    )
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    merged = out / "trl-merged"
    trained = trainer.model.merge_and_unload() if cfg.train.lora else trainer.model
    trained.save_pretrained(merged)
    tokenizer.save_pretrained(merged)
    return merged, {"setup_s": t1 - t0, "train_s": t2 - t1, "seconds": t2 - t0, "train_reward": rewards}


def points_per_min(first: dict, final: dict, seconds: float) -> float:
    """Held-out accuracy gained, in percentage points, per minute of SECONDS."""
    return 100 * (final["eval/accuracy"] - first["eval/accuracy"]) / (seconds / 60)


def evaluate(cfg, model: Path, run_dir: Path) -> dict:
    """Held-out eval of MODEL with the demo's evaluation (a run whose policy 0 is MODEL)."""
    from pipeline.eval.run import eval_summary, run_eval
    from pipeline.run.run import init_run

    run = init_run(str(run_dir), cfg.model_copy(update={"model": str(model)}))
    run_eval(run, 0)
    return eval_summary(run, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibrate_real", description=__doc__.splitlines()[0])
    ap.add_argument("--ours", type=Path, required=True, help="the `make demo-real` DIR to compare with (its summary.json)")
    ap.add_argument("--dir", type=Path, default=None, help="where TRL's output goes (default OURS/trl)")
    ap.add_argument("--iters", type=int, default=None, help="TRL generation cycles (default: the demo's iterations)")
    ap.add_argument("--bf16", action="store_true", help="TRL with bf16=True (the faster on CPUs with AVX512-bf16/AMX)")
    args = ap.parse_args(argv)
    ours_dir = args.ours.resolve()
    summary_path = ours_dir / "summary.json"
    if not summary_path.is_file():
        print(f"error: {summary_path}: no summary; run `make demo-real DEMO_DIR={args.ours}` first", file=sys.stderr)
        return 1
    ours = json.loads(summary_path.read_text())
    if ours.get("resumed"):
        print(f"error: {summary_path}: that demo run was resumed, so its seconds are not one run's; use a fresh DEMO_DIR", file=sys.stderr)
        return 1
    out = (args.dir or ours_dir / "trl").resolve()
    if out.exists():
        print(f"error: {out}: exists; remove it or give --dir", file=sys.stderr)
        return 1
    cycles = args.iters or ours["iters"]
    os.chdir(REPO)  # the example configs name examples/rewards.py relative to the repository root
    from pipeline.models.engines import cpu_env

    cpu_env()
    from pipeline import config as config_mod
    from pipeline.errors import GRPOError

    try:
        config_path = ours_dir / "run" / "config.yaml"  # the demo run's own config: same data files, seed, everything
        cfg = config_mod.from_yaml_text(config_path.read_text(), source=str(config_path))
        merged, trl = train_trl(cfg, out, cycles, args.bf16)
        final = evaluate(cfg, merged, out / "eval-run")
    except GRPOError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    first = ours["first"]
    gain = {"ours": points_per_min(first, ours["final"], ours["train_s"]), "trl": points_per_min(first, final, trl["seconds"])}
    result = {"cycles": cycles, "trl_precision": "bf16" if args.bf16 else "fp32", "ours": ours, "trl": {**trl, "final": final},
              "accuracy_points_per_min": gain, "ratio": gain["ours"] / gain["trl"] if gain["trl"] > 0 else None}
    (out / "calibration.json").write_text(json.dumps(result, indent=1))
    print(f"held-out accuracy at the start (policy 0, both): {first['eval/accuracy']:.3f} (reward {first['eval/reward']:.3f})")
    print(f"grpo:      accuracy {ours['final']['eval/accuracy']:.3f} (reward {ours['final']['eval/reward']:.3f}) after {ours['iters']} iterations "
          f"in {ours['train_s']:.0f}s (held-out evals excluded): {gain['ours']:+.2f} points/min")
    print(f"TRL 1.16 ({result['trl_precision']}): accuracy {final['eval/accuracy']:.3f} (reward {final['eval/reward']:.3f}) after {cycles} cycles "
          f"in {trl['seconds']:.0f}s (load {trl['setup_s']:.0f}s + train {trl['train_s']:.0f}s): {gain['trl']:+.2f} points/min")
    ratio = f"{result['ratio']:.2f}x" if result["ratio"] is not None else "n/a (TRL gained no accuracy)"
    print(f"held-out accuracy gained per minute, grpo / TRL: {ratio}; written {out / 'calibration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
