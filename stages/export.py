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
    import json
    import shutil

    from pipeline.errors import GRPOError
    from pipeline.models.lora import ADAPTER_CONFIG, is_adapter
    from pipeline.store.run import Run
    from pipeline.store import MANIFEST, hash_dir

    r = Run(run)
    k = r.completed_iters() if iter is None else iter
    src = r.policy_dir(k, needed_by="export")
    for j in {0, k}:  # a merged export reads the base too
        expected = r.store.manifest(f"policy/iter-{j:04d}").files
        if hash_dir(r.policy_dir(j, needed_by="export")) != expected:
            raise GRPOError(f"{r.store.display(f'policy/iter-{j:04d}')}: files do not match the policy manifest (run `grpo audit`)")
    if out.exists() and any(out.iterdir()):
        raise GRPOError(f"{out}: exists and is not empty; choose a new directory")
    adapter = is_adapter(src)
    if adapter and merged:
        from pipeline.models.lora import merge

        merge(r.policy_dir(0), src, out)
        print(f"policy {k} (adapter merged into policy 0) -> {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))")
        return
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST, ".complete"))
    if adapter:
        base = r.policy_dir(0).resolve()
        conf = json.loads((out / ADAPTER_CONFIG).read_text())
        conf["base_model_name_or_path"] = str(base)
        (out / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2, sort_keys=True))
        print(f"policy {k} (LoRA adapter) -> {out} (load with PeftModel.from_pretrained(base, '{out}'), base {base}; "
              "--merged for a plain model)")
        return
    print(f"policy {k} -> {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))")
