"""`iterate` with train.max_staleness s >= 1: the sampling overlapped with the training.

A sampler process, spawned once per `iterate` and holding its own warm engine, runs rollouts and
evals in the order they are asked for; this process scores, computes logprobs and updates, and
never starts an engine itself. At the start of iteration k (policy k exists) every rollout j <
iters whose behaviour policy b(j) = j - s exists and that is not done is queued (with s = 1:
rollout k+1, from policy k), then this process waits for rollout k and trains on it while the
sampler samples ahead. The eval of policy k+1 is queued after update k and waited for before
iteration k's row is printed, as `iterate` without staleness spends that time too.

What is written never depends on this timing: which policy samples which iteration is fixed by
the config (pipeline/staleness.py), every stage skips what is done and redoes what died, so a
rerun, the separate stage commands and a resume after SIGKILL give the same bytes. A SIGKILL of
this process takes the sampler with it (PR_SET_PDEATHSIG); a sampler that dies ends this process
with a one-line error; either way the same command then finishes the run.

Memory: two processes, the sampler's engine (weights + KV cache, both given back to the OS
while nothing is queued, as in `iterate`) beside the logprob models and the trainer. CPU: both
share the machine's cores unless GRPO_SAMPLER_CPUS (e.g. `0`) pins the sampler, before torch
starts its threads, to those CPUs (the trainer then belongs on the others, e.g. with taskset).
"""

from __future__ import annotations

import os
import time
from typing import Callable

from pipeline.errors import GRPOError
from pipeline.store.run import Run

SAMPLER_CPUS = "GRPO_SAMPLER_CPUS"


class Sampler:
    """The sampling process and the requests this process has made of it."""

    def __init__(self, run: Run):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch threads or engine state inherited
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(run.uri, child, os.getpid()), name="grpo-sampler")
        self.proc.start()
        child.close()
        self.asked: set[tuple[str, int]] = set()
        self.done: set[tuple[str, int]] = set()

    def ask(self, kind: str, k: int) -> None:
        if (kind, k) not in self.asked:
            self.asked.add((kind, k))
            try:
                self.conn.send((kind, k))
            except OSError:  # the sampler is dead: the wait for what it still owes says so, in one line
                pass

    def wait(self, kind: str, k: int) -> None:
        """Until the sampler has finished `kind` of iteration k (asked for before)."""
        while (kind, k) not in self.done:
            try:
                status, what, j, text = self.conn.recv()
            except (EOFError, OSError):
                self.proc.join(10)
                raise GRPOError(f"iterate: the sampler process died ({_how(self.proc.exitcode)}) before {kind} of iteration {k} "
                                "was done; rerun the same command to resume") from None
            if status == "error":
                raise GRPOError(text)
            self.done.add((what, j))

    def close(self) -> None:
        try:
            self.conn.send(("stop", -1))
        except OSError:
            pass
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _how(code: int | None) -> str:
    """A process's end in words: `exit 1`, `killed by SIGKILL`."""
    import signal

    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def iterate_overlapped(run: Run, iters: int, on_iteration: Callable[[dict], None] | None = None) -> list[dict]:
    """`pipeline.iterate.iterate` for train.max_staleness >= 1 (see the module docstring)."""
    from pipeline.iteration import WarmEngines, eval_due, finish_row, learn
    from pipeline.report import tracking
    from pipeline.staleness import behaviour

    cfg = run.cfg
    start = run.completed_iters()
    sampler = None
    warm = WarmEngines(run)  # logprob models and the trainer; its engine stays None here
    rows = []

    def ask(kind: str, k: int) -> None:
        nonlocal sampler
        if sampler is None:
            sampler = Sampler(run)
        sampler.ask(kind, k)

    def feed(newest: int) -> None:
        """Queue every rollout still to do whose behaviour policy exists (policy `newest` does)."""
        for j in range(start, iters):
            if behaviour(cfg, j) <= newest and not run.done(j, "rollout"):
                ask("rollout", j)

    try:
        if cfg.eval.every and cfg.data.eval and not run.done(0, "eval"):
            ask("eval", 0)
        for k in range(start, iters):
            t0 = time.time()
            feed(k)
            if not run.done(k, "rollout"):
                sampler.wait("rollout", k)
            timings = {"rollout": time.time() - t0}  # the wait: what the overlap did not hide
            learn(run, warm, k, t0, timings)
            if eval_due(run, k + 1) and not run.done(k + 1, "eval"):
                ask("eval", k + 1)  # behind rollout k+1 (running), ahead of rollout k+2
                sampler.wait("eval", k + 1)
                timings["eval"] = time.time() - t0 - sum(timings.values())
            rows.append(finish_row(run, k, t0, timings, on_iteration))
        if sampler is not None and ("eval", 0) in sampler.asked:
            sampler.wait("eval", 0)
        if sampler is not None:
            sampler.close()  # the rollouts queued beyond `iters` are none: feed stops at iters
            sampler = None
        tracking.log_final(run)
    finally:
        if sampler is not None:
            sampler.close()
        warm.close()
    return rows


def serve(uri: str, conn, parent: int) -> None:
    """The sampler process: rollouts and evals as asked, one at a time, on one warm engine."""
    _die_with(parent)
    cpus = os.environ.get(SAMPLER_CPUS)
    if cpus:  # before torch starts: its thread pool is sized from this mask
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    from pipeline.evaluate import run_eval
    from pipeline.models.engines import cpu_env
    from pipeline.report import tracking
    from pipeline.rollout import policy_engine, run_rollout
    from pipeline.staleness import behaviour

    cpu_env()
    run = Run(uri)
    engine = None
    try:
        while True:
            if engine is not None and hasattr(engine, "sleep") and not conn.poll():
                engine.sleep()  # nothing queued: the trainer beside it gets the memory
            try:
                kind, k = conn.recv()
            except (EOFError, OSError):
                return  # the iterate process is gone
            if kind == "stop":
                return
            try:
                with tracking.reporting(run, k, kind):
                    if kind == "rollout" and not run.done(k, "rollout"):
                        engine = policy_engine(run, behaviour(run.cfg, k), engine)
                        run_rollout(run, k, engine=engine)
                    elif kind == "eval" and not run.done(k, "eval"):
                        engine = policy_engine(run, k, engine)
                        run_eval(run, k, engine)
                conn.send(("done", kind, k, None))
            except GRPOError as err:
                conn.send(("error", kind, k, str(err)))
            except Exception as err:  # noqa: BLE001 - reported by the iterate process, with the traceback here
                import traceback

                traceback.print_exc()
                conn.send(("error", kind, k, f"sampler, {kind} of iteration {k}: {type(err).__name__}: {err}"))
    finally:
        if engine is not None:
            engine.close()


def _die_with(parent: int) -> None:
    """SIGKILL this process when the iterate process dies, however it dies (Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
