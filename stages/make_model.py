"""`grpo make-data` and `grpo make-model`: the demo's data and starting policy, built offline.

    grpo make-data data/demo                       # -> data/demo/train.jsonl, eval.jsonl
    grpo make-model models/tiny --data data/demo   # -> HF model dir + make_model.json

make-model trains a byte-level BPE on the demo text, builds a Qwen2 (tiny ~4M / small ~30M
parameters), warm-starts it briefly on train.jsonl and records its held-out greedy accuracy on
eval.jsonl. Both commands are deterministic given --seed and refuse to overwrite different output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline import demo_task
from pipeline.errors import GRPOError

N_TRAIN = 4000
SFT_STEPS = 500  # keep equal to pipeline.tinymodel.SFT_STEPS (not imported: torch stays out of --help)

Seed = Annotated[int, typer.Option(help="Seed of the generator, the weights and the warm start.", min=0)]


def make_data(
    out: Annotated[Path, typer.Argument(help="Directory to write train.jsonl and eval.jsonl into.")],
    n_train: Annotated[int, typer.Option(help="Training problems.", min=1)] = N_TRAIN,
    n_eval: Annotated[int, typer.Option(help="Held-out problems (disjoint from training).", min=1)] = 200,
    seed: Seed = 0,
) -> None:
    """Write the demo's arithmetic word problems (GSM8K-style `answer` with `#### n`)."""
    train_path, eval_path = demo_task.write_demo_data(out, n_train=n_train, n_eval=n_eval, seed=seed)
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
    from pipeline import tinymodel  # torch and transformers load here, not at `grpo --help`

    record = tinymodel.make_model(out, size=size, seed=seed, data_dir=data, sft_steps=sft_steps)
    acc = record["eval_accuracy"]
    acc_text = f"held-out greedy accuracy {acc:.1%} on {record['eval_rows']} problems" if acc is not None else "no eval data"
    verb = "kept existing" if record.get("skipped") else "wrote"
    print(
        f"make-model: {verb} {out} ({record['size']}, {record['params'] / 1e6:.1f}M params, "
        f"{record['sft_steps']} SFT steps), {acc_text}, {record['seconds']:.0f} s"
    )
