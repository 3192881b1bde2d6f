"""`grpo`: the command line. One module per command; heavy libraries load inside commands.

    grpo init RUN --config configs/demo.yaml
    grpo iterate RUN --iters 5        # or the four stages one by one:
    grpo rollout RUN; grpo score RUN; grpo logprobs RUN; grpo update RUN
"""

import sys
import warnings
from pathlib import Path

import typer

from pipeline.errors import GRPOError
from stages import demo, eval, export, init, iterate, logprobs, make_model, rollout, score, status, update
from stages import inspect
from stages import audit, replay

app = typer.Typer(
    name="grpo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="GRPO fine-tuning as four reproducible, resumable stages exchanging Parquet shards.",
)
app.command("init")(init.init)
app.command("rollout")(rollout.rollout)
app.command("score")(score.score)
app.command("logprobs")(logprobs.logprobs)
app.command("update")(update.update)
app.command("iterate")(iterate.iterate)
app.command("eval")(eval.evaluate)
app.command("status")(status.status)
app.command("inspect")(inspect.inspect)
app.command("demo")(demo.demo)
app.command("export")(export.export)
app.command("audit")(audit.audit)
app.command("replay")(replay.replay)
app.command("make-data")(make_model.make_data)
app.command("make-model")(make_model.make_model)


def main() -> None:
    # vLLM 0.32 touches torch.distributed.reduce_op, deprecated in torch 2.13: two FutureWarnings
    # per process that say nothing about the user's run
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    try:
        app()
    except GRPOError as err:
        print(f"error: {err}", file=sys.stderr)
        _exit(1)
    except SystemExit as done:  # typer ends every command this way
        if done.code is None or isinstance(done.code, int):
            _exit(done.code or 0)
        raise


def _exit(code: int) -> None:
    """End the process. Once vLLM or DeepSpeed is loaded, the interpreter's teardown (their atexit
    hooks, freeing torch's and vLLM's objects one by one) took 7-16 s per command and does nothing
    a run needs: every artifact is written and closed, MLflow logs synchronously, the trainer has
    left its process group. So flush and leave at once; other commands, and main() called from
    inside another program (tests), exit normally."""
    if not (_is_entry_point() and any(m in sys.modules for m in ("vllm", "deepspeed"))):
        sys.exit(code)
    import logging
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _is_entry_point() -> bool:
    """Whether this process is `grpo` itself: the console script, or `python -m stages.cli`."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    return (spec is not None and spec.name == "stages.cli") or Path(getattr(top, "__file__", "") or "").name == "grpo"


if __name__ == "__main__":
    main()
