"""`grpo export RUN OUT [--iter K] [--merged]`: a policy out of the run.

policy/iter-K (default: the newest) -> OUT (refuses to overwrite a non-empty OUT). A full
fine-tuning policy is a plain Hugging Face model directory. A LoRA policy (K >= 1) is exported
as its PEFT adapter (base_model_name_or_path = the run's policy/iter-0000), or with --merged as
a plain Hugging Face model with the adapter merged into the base's weights.
"""

from pathlib import Path
from typing import Annotated

import typer

from stages.options import IterOpt, RunArg


def export(
    run: RunArg,
    out: Annotated[Path, typer.Argument(help="New directory for the model.")],
    iter: IterOpt = None,
    merged: Annotated[bool, typer.Option("--merged", help="LoRA runs: the base with the adapter merged in (a plain HF model).")] = False,
) -> None:
    """Copy policy K out of the run, verified against its manifest."""
    from pipeline.errors import GRPOError
    from pipeline.run.run import Run
    from pipeline.store import hash_dir

    r = Run(run)
    k = r.completed_iters() if iter is None else iter
    for j in {0, k}:  # a merged export reads the base too
        where = r.policy_dir(j, needed_by="export")  # a policy missing, or its write interrupted: one line
        expected = r.store.manifest(f"policy/iter-{j:04d}").files
        if hash_dir(where) != expected:
            raise GRPOError(f"{r.store.display(f'policy/iter-{j:04d}')}: files do not match the policy manifest (run `grpo audit`)")
    if out.exists() and any(out.iterdir()):
        raise GRPOError(f"{out}: exists and is not empty; choose a new directory")
    print(r.policy.export(r, k, out, merged))
