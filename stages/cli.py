"""`grpo`: the command line. One module per command; heavy libraries load inside commands.

    grpo init RUN --config my-run.yaml    # or: --model M --data train.jsonl --reward correct ...
    grpo iterate RUN --iters 5        # or the four stages one by one:
    grpo rollout RUN; grpo score RUN; grpo logprobs RUN; grpo update RUN
"""

import sys
import warnings
from pathlib import Path

import typer

from pipeline.errors import GRPOError
from demo.commands import register as register_demo
from stages import eval, export, init, iterate, logprobs, rollout, score, status, update
from stages import inspect
from stages import audit, conformance, replay

app = typer.Typer(
    name="grpo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="GRPO fine-tuning as four reproducible, resumable stages exchanging Parquet shards.",
)
app.command("init", epilog=init.EXAMPLE)(init.init)
app.command("rollout")(rollout.rollout)
app.command("score")(score.score)
app.command("logprobs")(logprobs.logprobs)
app.command("update")(update.update)
app.command("iterate")(iterate.iterate)
app.command("eval")(eval.evaluate)
app.command("status")(status.status)
app.command("inspect")(inspect.inspect)
app.command("export")(export.export)
app.command("audit")(audit.audit)
app.command("replay")(replay.replay)
app.command("conformance")(conformance.conformance)
register_demo(app)  # demo, make-data, make-model: the embedded demo, its own package


def main() -> None:
    # vLLM 0.32 touches torch.distributed.reduce_op, deprecated in torch 2.13: two FutureWarnings
    # per process that say nothing about the user's run
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    from pipeline.models.engines import cpu_env

    cpu_env()  # before any library reads its settings: quiet logs, no weight-loading bars
    _exit(run_cli())


def run_cli(args: list[str] | None = None) -> int:
    """The app with every failure as one `error: ...` line: ours, Typer's usage errors alike.
    Ctrl-C unwinds the stage (locks are released on the way out) and says how to go on."""
    from typer._click import exceptions as click_errors  # Typer vendors its click
    from typer.core import Abort

    try:
        rv = app(args=args, prog_name="grpo", standalone_mode=False)
    except GRPOError as err:
        from pipeline.config.urls import scrub  # a secret this process sent is never in its last word either

        print(f"error: {scrub(str(err))}", file=sys.stderr)
        if not _interrupted(err):
            return 1
        rv = 130  # a Ctrl-C came first; this error came as it unwound the command (a background write's, waited for at close)
    except click_errors.NoArgsIsHelpError as err:
        err.show()  # the help page, as `grpo CMD --help` prints it
        return 0
    except (click_errors.UsageError, click_errors.BadParameter) as err:
        where = err.ctx.command_path if err.ctx is not None else "grpo"
        print(f"error: {err.format_message().rstrip('.')} (see '{where} --help')", file=sys.stderr)
        return err.exit_code
    except Abort:  # Ctrl-C at a prompt, or end of input
        rv = 130
    if rv == 130:  # typer turns KeyboardInterrupt into exit code 130
        print("interrupted; rerun the same command to resume", file=sys.stderr)
    return rv if isinstance(rv, int) else 0


def _interrupted(err: BaseException) -> bool:
    """Whether `err` was raised while a Ctrl-C unwound the command (it stays a Ctrl-C: exit 130)."""
    seen, e = set(), err.__context__
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


def _exit(code: int) -> None:
    """End the process. The interpreter's teardown does nothing a run needs once a command has
    returned: every artifact is written and closed, locks are released, MLflow logs
    synchronously, the trainer has left its process group. And it is slow: with vLLM or DeepSpeed
    loaded (their atexit hooks, freeing torch's and vLLM's objects one by one) it took 7-16 s per
    command; with only MLflow, SQLAlchemy, pyarrow and polars loaded it was 1.3 s of a 4.5 s
    `grpo score`. So flush and leave at once; main() called from inside another program (tests)
    exits normally."""
    if not _is_entry_point():
        sys.exit(code)
    leave(code)


def leave(code: int) -> None:
    """Flush stdout, stderr and the logs, and end the process now (no interpreter teardown)."""
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
