"""`grpo iterate RUN --iters N | --more K`: rollout -> score -> logprobs -> update, N times.

Skips what is done and redoes what died: rerunning after a crash finishes the same N.
Engines stay warm across iterations (vLLM weights reloaded in place).
"""

from typing import Annotated, Optional

import typer

from stages.options import RunArg


def iterate(
    run: RunArg,
    iters: Annotated[Optional[int], typer.Option("--iters", min=0, help="Bring the run to N completed iterations.")] = None,
    more: Annotated[Optional[int], typer.Option("--more", min=1, help="K iterations more than are done (for schedulers).")] = None,
    executor: Annotated[Optional[str], typer.Option("--executor", help="local or ray (default: the run's cluster.executor).")] = None,
    address: Annotated[Optional[str], typer.Option("--address", help="The Ray cluster to join (default: cluster.address).")] = None,
) -> None:
    """Run whole iterations with warm engines and print a table as they finish."""
    from pipeline.errors import GRPOError
    from pipeline.loop.iterate import iterate as run_iterate
    from pipeline.run.run import Run
    from stages.report import IterationTable

    if (iters is None) == (more is None):
        raise GRPOError("iterate: give exactly one of --iters N or --more K")
    r = Run(run)
    target = iters if iters is not None else r.completed_iters() + more
    if executor not in (None, "local", "ray"):
        raise GRPOError(f"--executor {executor!r}: expected local or ray")
    table = IterationTable(r)
    run_iterate(r, target, on_iteration=table.add, sampler=_sampler(r, executor, address))
    table.finish(target)


def _sampler(run, executor: str | None, address: str | None):
    """What makes the loop's sampler: a Ray cluster's at `address` (default cluster.address) where
    `executor` (default cluster.executor) is ray, else the loop's own on this machine."""
    from pipeline.config.rules import refusal
    from pipeline.errors import GRPOError
    from pipeline.loop.iterate import local_sampler

    cfg = run.cfg
    if executor and executor != cfg.cluster.executor and (why := refusal(cfg.model_copy(
            update={"cluster": cfg.cluster.model_copy(update={"executor": executor})}))):
        raise GRPOError(f"--executor {executor}: {why}")  # the rules a config with this executor would break
    if (executor or cfg.cluster.executor) != "ray":
        return local_sampler
    from pipeline.cluster.executor import RaySampler

    return lambda run, warm: RaySampler(run, warm, address)
