"""`grpo make-data OUT` and `grpo make-model OUT`: the demo task's data and a tiny local model.

No hub is reachable here, so the project builds its own: generated arithmetic word problems
(GSM8K style) and a Qwen2-architecture causal LM with a locally trained byte-level BPE
tokenizer, optionally warm-started by a brief supervised pass on the task.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer


def make_data(
    out: Annotated[Path, typer.Argument(help="Directory for train.jsonl and eval.jsonl.")],
    n_train: Annotated[int, typer.Option("--n-train", min=1, help="Training problems.")] = 4000,
    n_eval: Annotated[int, typer.Option("--n-eval", min=1, help="Held-out problems.")] = 200,
    seed: Annotated[int, typer.Option("--seed", help="Seed.")] = 0,
) -> None:
    """Write the demo task's train and held-out eval problems."""
    from pipeline.demo_task import write_demo_data

    train, eval_ = write_demo_data(out, n_train=n_train, n_eval=n_eval, seed=seed)
    print(f"wrote {train} ({n_train} rows) and {eval_} ({n_eval} rows)")


def make_model(
    out: Annotated[Path, typer.Argument(help="Directory for the model (HF format).")],
    size: Annotated[str, typer.Option("--size", help="tiny (~5M params) or small (~30M).")] = "tiny",
    data: Annotated[Optional[Path], typer.Option("--data", help="Demo data dir to warm-start on (from make-data).")] = None,
    sft_steps: Annotated[Optional[int], typer.Option("--sft-steps", min=0, help="Supervised warm-start steps.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed.")] = 0,
) -> None:
    """Build a Qwen2 model + tokenizer, warm-start it on the demo task, save it."""
    from pipeline.errors import GRPOError
    from pipeline.tinymodel import make_model as build

    if size not in ("tiny", "small"):
        raise GRPOError(f"--size {size!r}: expected tiny or small")
    kwargs = {} if sft_steps is None else {"sft_steps": sft_steps}
    rec = build(out, size=size, seed=seed, data_dir=data, **kwargs)
    print(f"model {out}: {rec['params'] / 1e6:.1f}M params, held-out greedy accuracy {rec.get('eval_accuracy')}, {rec.get('seconds')}s")
