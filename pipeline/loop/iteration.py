"""One iteration's pieces for the loop (pipeline/loop/iterate.py): the warm engines, what the loop
asks of a sampler besides rollouts (`LocalSampler`), the learning half of an iteration (score,
logprobs, update), the row a person reads per iteration, and the loop's waits for the record
(`settle_record` before each update, `wait_at_end`, and `Rows`, which shows a row once its record is safe)."""

from __future__ import annotations

import time
from typing import Callable

from pipeline.report import tracking
from pipeline.eval.run import eval_summary
from pipeline.logprobs import run_logprobs
from pipeline.loop.sampler import Sampler
from pipeline.run.policy import LogprobModels
from pipeline.rollout import engine_settings, policy_engine
from pipeline.run.run import Run
from pipeline.score import run_score
from pipeline.update import record
from pipeline.update.publish import flush_state, run_update


class WarmEngines:
    """The rollout engine, logprob models and trainer, created on first use and kept."""

    def __init__(self, run: Run):
        self.run = run
        self.engine = None
        self.logprobs = LogprobModels(run)  # the logprob pass's models, kept across iterations
        self.trainer = None
        self.readers_here = False
        """Whether every reader of a policy's files is in this process (the sampler is), so that
        the update's record may be written on a thread (`record.save_policy` decides)."""
        self.unlogged: int | None = None
        """The update this loop ran, until it is logged: once its record is not in flight (`_log_recorded`)."""
        # the engine shares the machine with the trainer: a GPU split that cannot fit fails here,
        # before any engine or model loads
        self.settings = engine_settings(run, run.completed_iters(), shared=True)

    def rollout_engine(self, k: int, where: str | None = None):
        """The engine holding policy k; rollout.weight_sync memory hands it the trainer's
        weights where the trainer just published policy k (else it reads the stored policy).
        `where` names the stage in the error of an engine that does not hold it."""
        weights = None
        if self.engine is not None and self.trainer is not None and self.run.cfg.weight_sync == "memory":
            weights = self.trainer.published_weights(self.run.policy_dir(k, weights=False))
        self.engine = policy_engine(self.run, k, self.engine, settings=self.settings, weights=weights, where=where)
        return self.engine

    def idle_engine(self) -> None:
        """Between generations the engine's KV cache and weights go back to the OS, so the
        update's peak memory does not stack on them (the next rollout or eval takes them again,
        with the new policy's weights)."""
        if self.engine is not None and hasattr(self.engine, "sleep"):
            self.engine.sleep()

    def close(self) -> None:
        """A record still in flight is settled and the trainer's state written if it is not on disk
        (train.state_every: at the end of `iterate`, on Ctrl-C or an error), then the engines close."""
        try:
            record.settle_before_update(self.run, None)  # a record in flight is written from the trainer's tensors
            flush_state(self.run, self.trainer)
        finally:
            if self.engine is not None:
                self.engine.close()
            if self.trainer is not None:
                self.trainer.close()


class LocalSampler(Sampler):
    """The `Sampler` answers shared by the samplers on this machine (this process, or a sampler
    process beside it): the score in this process, the update left to the loop's warm trainer, no
    figures. Their rollouts and evals (`ask`, `wait`, `drain`, `close`) are each one's own."""

    run: Run

    def score(self, k: int) -> None:
        run_score(self.run, k)

    def update(self, k: int) -> bool:
        """Whether the sampler ran iteration k's update itself (False: the loop's trainer does)."""
        return False

    def figures(self, k: int) -> dict:
        return {}


def learn(run: Run, warm: WarmEngines, k: int, t0: float, timings: dict, sampler: Sampler) -> None:
    """Score, logprobs and update of iteration k (its rollout is done), each timed into `timings`;
    the sampler scores (and may take the update: a Ray cluster's placed ranks)."""
    with tracking.reporting(run, k, "score"):
        sampler.score(k)
    timings["score"] = time.time() - t0 - sum(timings.values())
    with tracking.reporting(run, k, "logprobs"):
        run_logprobs(run, k, models=warm.logprobs)
    timings["logprobs"] = time.time() - t0 - sum(timings.values())
    timings["record"] = settle_record(run, warm, k)  # update k changes the tensors policy k's file is written from
    if not run.done(k, "update"):  # nothing in flight now: never waits
        warm.unlogged = k
    if not sampler.update(k):
        # iterate writes the state at its end; update k's record may be written while rollout k+1 runs
        _, warm.trainer = run_update(run, k, warm.trainer, final=False, readers_here=warm.readers_here)
    _log_recorded(run, warm)
    timings["update"] = time.time() - t0 - sum(timings.values())


def settle_record(run: Run, warm: WarmEngines, k: int) -> float:
    """The loop's wait for the record of update k-1 (policy k's write, if still in flight): returns
    the seconds waited; its error raised. Update k-1 is logged then (if it was not already)."""
    waited = record.settle_before_update(run, k) if run.writing(k) is not None else 0.0
    _log_recorded(run, warm)
    return waited


def wait_at_end(run: Run, warm: WarmEngines, rows: list[dict], shown: "Rows") -> None:
    """The loop's one wait at its end, for the newest policy's record: its seconds go into the last
    iteration's row (its timings' `record`), which is then shown."""
    waited = settle_record(run, warm, run.completed_iters())
    if rows:
        rows[-1]["timings"]["record"] += waited
        rows[-1]["seconds"] += waited
    shown.show(wait=True)


def _log_recorded(run: Run, warm: WarmEngines) -> None:
    """The update this loop ran and has not logged yet (`warm.unlogged`), logged (diagnostics,
    MLflow) once its record is no longer in flight: at once where it was written inline, else
    after the loop's wait for it."""
    if warm.unlogged is not None and run.writing(warm.unlogged + 1) is None:
        due, warm.unlogged = warm.unlogged, None
        if run.done(due, "update"):
            tracking.log_stage(run, due, "update")


def finish_row(run: Run, k: int, t0: float, timings: dict, on_iteration) -> dict:
    row = iteration_summary(run, k)
    row.update(eval_summary(run, k + 1) or {})  # the policy this iteration produced
    row["seconds"] = time.time() - t0
    row["timings"] = timings
    if on_iteration:
        on_iteration(row)
    return row


def iteration_summary(run: Run, k: int) -> dict:
    """The numbers a person checks per iteration: reward, eval accuracy (of policy k+1), KL."""
    import numpy as np
    import pyarrow as pa

    from pipeline.run.parts import read_parts
    from schemas.artifacts import SCORE, UPDATE_METRICS

    row: dict = {"iteration": k}
    if run.done(k, "score"):
        score = pa.concat_tables(read_parts(run, k, "score", SCORE))
        rewards = score.column("reward").to_numpy(zero_copy_only=False)
        row["reward/mean"] = float(np.nanmean(rewards))
        row["frac_reward_zero_std"] = float(np.mean(score.column("zero_std").to_numpy(zero_copy_only=False)))
    if run.completed_iters() > k:  # never waits: its metrics are written before its manifest's background write
        m = run.store.read_table(f"iter-{k:04d}/update/metrics.parquet", UPDATE_METRICS)
        kl = m.column("kl/mean").to_numpy(zero_copy_only=False)
        row["kl/mean"] = float(np.nanmean(kl)) if len(kl) and not np.isnan(kl).all() else float("nan")
    return row


class Rows:
    """Iteration k's row is shown once its record is safe: update k's manifest and policy k+1 on disk
    (their write, pipeline/update/record.py, may run on while rollout k+1 does), or together with
    that write's failure, never before it. A row waits while its write is in flight; the next
    iteration's start, the loop's end, or an unwinding Ctrl-C shows it."""

    def __init__(self, run: Run, on_iteration: Callable[[dict], None] | None):
        self.run, self.on_iteration, self.waiting = run, on_iteration, None

    def hold(self, k: int, row: dict) -> None:
        self.show(wait=True)  # the one before (its write has finished: this update waited for it)
        self.waiting = (k, row)
        self.show(wait=False)

    def show(self, wait: bool) -> None:
        """The waiting row, if its write has ended (`wait`: once it has); the write's failure raised after it."""
        if self.waiting is None:
            return
        k, row = self.waiting
        w = self.run.writing(k + 1)
        if w is not None and not wait and not w.files.done():
            return
        self.waiting = None
        try:
            self.run.policy_done(k + 1)  # settles the write: its error, if it failed
        finally:
            tracking.log_record_wait(self.run, k, row["timings"].get("record", 0.0))
            if self.on_iteration is not None:
                self.on_iteration(row)
