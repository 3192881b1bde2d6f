"""`grpo demo [--dir runs/demo] [--iters 24]`: the embedded default, end to end.

Writes demo data and a warm-started tiny model, creates a run from the shipped config
(pipeline/configs/demo.yaml) and runs `grpo iterate`, printing a table per iteration.
Everything lands under DIR: data/, model/, run/ (with its MLflow store).
"""

from pathlib import Path
from typing import Annotated

import typer


def demo(
    dir: Annotated[Path, typer.Option("--dir", help="Where the demo's data, model and run go.")] = Path("runs/demo"),
    iters: Annotated[int, typer.Option("--iters", min=1, help="GRPO iterations.")] = 24,
    size: Annotated[str, typer.Option("--size", help="Model size: tiny or small.")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed for data, model and run.")] = 0,
) -> None:
    """Build the tiny model and data, then run GRPO on them and show the eval accuracy."""
    import time

    from pipeline import config as config_mod
    from pipeline.engines import cpu_env

    cpu_env()  # before anything imports DeepSpeed (through transformers), which warns without it
    from pipeline.demo_task import SYSTEM_PROMPT, write_demo_data
    from pipeline.evaluate import eval_summary
    from pipeline.iterate import iterate
    from pipeline.run import init_run
    from pipeline.tinymodel import make_model
    from stages.report import IterationTable

    t0 = time.time()
    train, eval_ = write_demo_data(dir / "data", seed=seed)
    print(f"data: {train}, {eval_}")
    record = make_model(dir / "model", size=size, seed=seed, data_dir=dir / "data")
    print(f"model: {dir / 'model'} ({record['params'] / 1e6:.1f}M params, warm-start greedy accuracy {record['eval_accuracy']:.3f})")
    template = Path(__file__).resolve().parent.parent / "pipeline" / "configs" / "demo.yaml"
    cfg = config_mod.load(template, [f"model={dir / 'model'}", f"data.train={train}", f"data.eval={eval_}", f"seed={seed}"])
    cfg.data.system_prompt = SYSTEM_PROMPT
    run = init_run(str(dir / "run"), cfg)
    t1 = time.time()
    table = IterationTable(run)
    iterate(run, iters, on_iteration=table.add)
    table.finish(iters)
    first, last = eval_summary(run, 0), eval_summary(run, run.completed_iters())
    if first and last:
        print(f"held-out accuracy: {first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f} "
              f"({100 * (last['eval/accuracy'] - first['eval/accuracy']):+.1f} points) in {time.time() - t1:.0f}s of GRPO "
              f"({time.time() - t0:.0f}s in all)")
    print(f"results: {run.store.display()}  (grpo status {run.store.display()}; grpo inspect {run.store.display()})")
