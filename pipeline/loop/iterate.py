"""`iterate`: rollout -> score -> logprobs -> update for N iterations in one process.

What is done is skipped and what died is redone, so rerunning the same command after a crash
finishes the same N iterations, never more. The engines stay warm: vLLM receives each new
policy in place (`reload_weights`, from the stored policy or, with rollout.weight_sync memory,
from the trainer's memory), the logprob models and the DeepSpeed trainer are kept.
The artifacts are the ones the four separate commands write (the tests compare hashes).

One loop serves every schedule and executor. A sampler runs the rollouts and evals it is asked
for: `InlineSampler` here, on the warm engine, at once (train.max_staleness 0),
`pipeline.loop.overlap.ProcessSampler`, in a second process ahead of the training (max_staleness
>= 1), or `pipeline.cluster.executor.RaySampler`, on a Ray cluster's actors (cluster.executor ray; `grpo iterate` hands
it in), which also takes the score and, with cluster.update_workers > 1, the update. At the start of iteration k every rollout j whose behaviour policy b(j) exists (b(j) <= k,
`pipeline.schedule`) and that is not done is asked for; with s = 0 that is rollout k alone.
"""

from __future__ import annotations

import time
from typing import Callable

from pipeline.report import tracking
from pipeline.eval.run import run_eval
from pipeline.loop.sampler import Sampler
from pipeline.loop.iteration import LocalSampler, Rows, WarmEngines, finish_row, learn, wait_at_end
from pipeline.schedule import eval_due, iteration_plan
from pipeline.rollout import run_rollout
from pipeline.run.run import Run
from pipeline.update.publish import restore_policy


class InlineSampler(LocalSampler):
    """Rollouts and evals in this process, on the warm engine, run when asked."""

    def __init__(self, run: Run, warm: WarmEngines):
        self.run, self.warm = run, warm

    def ask(self, kind: str, k: int) -> None:
        run = self.run
        with tracking.reporting(run, k, kind):
            if kind == "rollout" and not run.done(k, "rollout"):
                run_rollout(run, k, engine=self.warm.rollout_engine(iteration_plan(run.cfg, k).behaviour, f"rollout iteration {k}"))
                self.warm.idle_engine()
            elif kind == "eval" and not run.done(k, "eval"):
                run_eval(run, k, self.warm.rollout_engine(k, f"eval of policy {k}"))

    def wait(self, kind: str, k: int) -> None:
        """Nothing to wait for: `ask` ran it."""

    def drain(self) -> None:
        """Nothing is still running."""

    def close(self) -> None:
        """The engine belongs to `WarmEngines`, which closes it."""


def local_sampler(run: Run, warm: WarmEngines) -> Sampler:
    """The sampler on this machine: in a second process ahead of the training with
    train.max_staleness >= 1 (pipeline/loop/overlap.py), else in this process on the warm engine."""
    if run.cfg.train.max_staleness:
        from pipeline.loop.overlap import ProcessSampler

        return ProcessSampler(run)
    warm.readers_here = True  # every reader of a policy's files is in this process
    return InlineSampler(run, warm)


def iterate(run: Run, iters: int, on_iteration: Callable[[dict], None] | None = None,
            sampler: Callable[[Run, WarmEngines], Sampler] = local_sampler) -> list[dict]:
    """Bring the run to `iters` completed iterations; returns one summary row per iteration run.
    `sampler` makes the sampler from the run and the loop's warm engines: `local_sampler`, or the
    one the caller picks (`grpo iterate` hands in a Ray cluster's, pipeline/cluster/executor.py).
    The artifacts do not depend on which."""
    cfg = run.cfg
    start = run.completed_iters()
    # a kill stopped the background write of the newest policy: its update again, hash checked
    trainer = restore_policy(run, start - 1) if start > 0 and not run.policy_done(start) else None
    try:
        warm = WarmEngines(run)
    except BaseException:
        if trainer is not None:
            trainer.close()
        raise
    warm.trainer = trainer
    try:
        sampler = sampler(run, warm)
    except BaseException:
        warm.close()
        raise
    rows, shown = [], Rows(run, on_iteration)
    try:
        # policy 0's eval, and the newest policy's where a kill or Ctrl-C came between its update and
        # its eval (the loop below evaluates only the policies it makes)
        for j in sorted({0, start} if start <= iters else {0}):
            if eval_due(cfg, j) and not run.done(j, "eval"):
                sampler.ask("eval", j)
        for k in range(start, iters):
            t0 = time.time()
            for j in range(start, iters):  # every rollout whose behaviour policy exists now (policy k does)
                if iteration_plan(cfg, j).behaviour <= k and not run.done(j, "rollout"):
                    sampler.ask("rollout", j)
            sampler.wait("rollout", k)
            timings = {"rollout": time.time() - t0}  # overlapped: the wait, what the overlap did not hide
            shown_at = time.time()
            shown.show(wait=False)  # iteration k-1's row, if policy k's write finished while rollout k ran
            t0 += time.time() - shown_at  # its `on_iteration` is not iteration k's work (nor its seconds)
            learn(run, warm, k, t0, timings, sampler)
            if eval_due(cfg, k + 1) and not run.done(k + 1, "eval"):
                sampler.ask("eval", k + 1)  # overlapped: behind rollout k+1 (running), ahead of rollout k+2
                sampler.wait("eval", k + 1)
                timings["eval"] = time.time() - t0 - sum(timings.values())
            extra = sampler.figures(k)
            rows.append(finish_row(run, k, t0, timings, lambda row, extra=extra: row.update(extra)))
            shown.hold(k, rows[-1])
        sampler.drain()  # the eval of policy 0, when it was asked of a sampler that runs ahead
        sampler.close()  # the rollouts it ran are all below `iters`: asking stops there
        wait_at_end(run, warm, rows, shown)  # the newest policy's record: the loop's one wait at its end
        tracking.log_final(run)  # the newest policy; plots were refreshed by each update/eval
    finally:
        try:
            sampler.close()
            warm.close()  # settles a record still in flight first
        finally:
            shown.show(wait=False)  # a Ctrl-C or an error after an iteration's write finished: its row still shows
    return rows
