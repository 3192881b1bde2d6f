"""The demo's commands, registered on the `grpo` app by `register`.

    grpo demo [--dir runs/demo] [--iters 24]       # everything below, then GRPO, end to end
    grpo make-data data/demo                       # -> data/demo/train.jsonl, eval.jsonl
    grpo make-model models/tiny --data data/demo   # -> HF model dir + make_model.json

`demo` writes demo data and a warm-started tiny model, creates a run from the shipped config
(demo/configs/demo.yaml) and runs `grpo iterate`, printing a table per iteration. Everything
lands under DIR: data/, model/, run/ (with its MLflow store). make-model trains a byte-level BPE
on the demo text, builds a Qwen2 (tiny ~4M / small ~30M parameters), warm-starts it briefly on
train.jsonl and records its held-out greedy accuracy on eval.jsonl. All are deterministic given
--seed and refuse to overwrite different output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from demo.settings import N_TRAIN, SFT_STEPS
from pipeline.errors import GRPOError

CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"

Seed = Annotated[int, typer.Option(help="Seed of the generator, the weights and the warm start.", min=0)]


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("make-data")(make_data)
    app.command("make-model")(make_model)


def demo(
    dir: Annotated[Path, typer.Option("--dir", help="Where the demo's data, model and run go.")] = Path("runs/demo"),
    iters: Annotated[int, typer.Option("--iters", min=1, help="GRPO iterations.")] = 24,
    size: Annotated[str, typer.Option("--size", help="Model size: tiny or small.")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Seed for data, model and run.")] = 0,
) -> None:
    """Build the tiny model and data, then run GRPO on them and show the eval accuracy."""
    import time

    from demo.task import SYSTEM_PROMPT, write_demo_data
    from demo.tinymodel import make_model as build
    from pipeline import config as config_mod
    from pipeline.eval.run import eval_summary
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import init_run
    from stages.report import IterationTable

    t0 = time.time()
    train, eval_ = write_demo_data(dir / "data", seed=seed)
    print(f"data: {train}, {eval_}")
    record = build(dir / "model", size=size, seed=seed, data_dir=dir / "data")
    print(f"model: {dir / 'model'} ({record['params'] / 1e6:.1f}M params, warm-start greedy accuracy {record['eval_accuracy']:.3f})")
    cfg = config_mod.load(CONFIG, [f"model={dir / 'model'}", f"data.train={train}", f"data.eval={eval_}", f"seed={seed}"])
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


def make_data(
    out: Annotated[Path, typer.Argument(help="Directory to write train.jsonl and eval.jsonl into.")],
    n_train: Annotated[int, typer.Option(help="Training problems.", min=1)] = N_TRAIN,
    n_eval: Annotated[int, typer.Option(help="Held-out problems (disjoint from training).", min=1)] = 200,
    seed: Seed = 0,
) -> None:
    """Write the demo's arithmetic word problems (GSM8K-style `answer` with `#### n`)."""
    from demo.task import write_demo_data

    train_path, eval_path = write_demo_data(out, n_train=n_train, n_eval=n_eval, seed=seed)
    print(f"make-data: wrote {train_path} ({n_train} rows) and {eval_path} ({n_eval} rows), seed {seed}")


def make_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the Hugging Face model into (must not exist or be empty).")],
    size: Annotated[str, typer.Option(help="tiny (~4M parameters) or small (~30M).")] = "tiny",
    data: Annotated[Path | None, typer.Option(help="Directory with train.jsonl (warm start) and eval.jsonl (accuracy).")] = None,
    sft_steps: Annotated[int, typer.Option(help="Supervised warm-start steps on train.jsonl (batch 16).", min=0)] = SFT_STEPS,
    seed: Seed = 0,
) -> None:
    """Build a tiny Qwen2 policy with its tokenizer, warm-start it, and save it."""
    if size not in ("tiny", "small"):
        raise GRPOError(f"--size must be tiny or small, got {size!r}")
    from demo import tinymodel  # torch and transformers load here, not at `grpo --help`

    record = tinymodel.make_model(out, size=size, seed=seed, data_dir=data, sft_steps=sft_steps)
    acc = record["eval_accuracy"]
    acc_text = f"held-out greedy accuracy {acc:.1%} on {record['eval_rows']} problems" if acc is not None else "no eval data"
    verb = "kept existing" if record.get("skipped") else "wrote"
    print(
        f"make-model: {verb} {out} ({record['size']}, {record['params'] / 1e6:.1f}M params, "
        f"{record['sft_steps']} SFT steps), {acc_text}, {record['seconds']:.0f} s"
    )
