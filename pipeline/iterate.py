"""`iterate`: rollout -> score -> logprobs -> update for N iterations in one process.

What is done is skipped and what died is redone, so rerunning the same command after a crash
finishes the same N iterations, never more. The engines stay warm: vLLM receives each new
policy in place (`reload_weights`, from the stored policy or, with rollout.weight_sync memory,
from the trainer's memory), the logprob models and the DeepSpeed trainer are kept.
The artifacts are the ones the four separate commands write (the tests compare hashes).
"""

from __future__ import annotations

import time
from typing import Callable

from pipeline.report import tracking
from pipeline.evaluate import run_eval
from pipeline.iteration import WarmEngines, eval_due, finish_row, learn
from pipeline.rollout import run_rollout
from pipeline.store.run import Run
from pipeline.staleness import behaviour

def iterate(run: Run, iters: int, on_iteration: Callable[[dict], None] | None = None) -> list[dict]:
    """Bring the run to `iters` completed iterations; returns one summary row per iteration run.
    With train.max_staleness >= 1 the sampling runs in its own process, ahead of the training
    (pipeline/overlap.py); the artifacts do not depend on which."""
    if run.cfg.train.max_staleness:
        from pipeline.overlap import iterate_overlapped

        return iterate_overlapped(run, iters, on_iteration)
    warm = WarmEngines(run)
    rows = []
    try:
        if run.cfg.eval.every and not run.done(0, "eval") and run.cfg.data.eval:
            with tracking.reporting(run, 0, "eval"):
                run_eval(run, 0, warm.rollout_engine(0))
        for k in range(run.completed_iters(), iters):
            t0 = time.time()
            timings = {}
            with tracking.reporting(run, k, "rollout"):
                if not run.done(k, "rollout"):
                    run_rollout(run, k, engine=warm.rollout_engine(behaviour(run.cfg, k)))
            warm.idle_engine()
            timings["rollout"] = time.time() - t0
            learn(run, warm, k, t0, timings)
            if eval_due(run, k + 1):
                with tracking.reporting(run, k + 1, "eval"):
                    run_eval(run, k + 1, warm.rollout_engine(k + 1))
                timings["eval"] = time.time() - t0 - sum(timings.values())
            rows.append(finish_row(run, k, t0, timings, on_iteration))
        tracking.log_final(run)  # the newest policy; plots were refreshed by each update/eval
    finally:
        warm.close()
    return rows
