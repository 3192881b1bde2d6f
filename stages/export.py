"""`grpo export RUN OUT [--iter K]`: a policy as a plain Hugging Face model directory.

policy/iter-K (default: the newest) -> OUT (refuses to overwrite a non-empty OUT)
"""

from pathlib import Path
from typing import Annotated

import typer

from stages.options import IterOpt, RunArg


def export(run: RunArg, out: Annotated[Path, typer.Argument(help="New directory for the model.")], iter: IterOpt = None) -> None:
    """Copy policy K out of the run, verified against its manifest."""
    import shutil

    from pipeline.errors import GRPOError
    from pipeline.run import Run
    from pipeline.store import MANIFEST, hash_dir

    r = Run(run)
    k = r.completed_iters() if iter is None else iter
    src = r.policy_dir(k, needed_by="export")
    expected = r.store.read_json(f"policy/iter-{k:04d}/{MANIFEST}")["files"]
    if hash_dir(src) != expected:
        raise GRPOError(f"{r.store.display(f'policy/iter-{k:04d}')}: files do not match the policy manifest (run `grpo audit`)")
    if out.exists() and any(out.iterdir()):
        raise GRPOError(f"{out}: exists and is not empty; choose a new directory")
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST, ".complete"))
    print(f"policy {k} -> {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))")
