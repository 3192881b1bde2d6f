"""`iterate` with train.max_staleness s >= 1: the sampling overlapped with the training.

`ProcessSampler`, the sampler of `pipeline.loop.iterate`'s one loop for this schedule: a process,
spawned once per `iterate` and holding its own warm engine (sized by the same engine settings as
`iterate`'s own engine), runs rollouts and evals in the order they are asked for; the iterate
process scores, computes logprobs and updates, and never starts an engine itself. At the start
of iteration k (policy k exists) every rollout j < iters whose behaviour policy b(j) = j - s
exists and that is not done is queued (with s = 1: rollout k+1, from policy k), then the loop
waits for rollout k and trains on it while the sampler samples ahead. The eval of policy k+1 is queued after update k and waited for before
iteration k's row is printed, as `iterate` without staleness spends that time too.

What is written never depends on this timing: which policy samples which iteration is fixed by
the config (pipeline/schedule.py), every stage skips what is done and redoes what died, so a
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

from pipeline.errors import GRPOError
from pipeline.loop.iteration import LocalSampler
from pipeline.run.run import Run

SAMPLER_CPUS = "GRPO_SAMPLER_CPUS"


class ProcessSampler(LocalSampler):
    """The sampling process, started at the first request, and the requests made of it
    (`pipeline.loop.sampler.Sampler`'s ask, wait, drain, close)."""

    def __init__(self, run: Run):
        self.run = run
        self.proc = self.conn = None
        self.asked: set[tuple[str, int]] = set()
        self.done: set[tuple[str, int]] = set()

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch threads or engine state inherited
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(self.run.uri, child, os.getpid()), name="grpo-sampler")
        self.proc.start()
        child.close()

    def ask(self, kind: str, k: int) -> None:
        if (kind, k) not in self.asked:
            if self.proc is None:
                self._start()
            self.asked.add((kind, k))
            try:
                self.conn.send((kind, k))
            except OSError:  # the sampler is dead: the wait for what it still owes says so, in one line
                pass

    def wait(self, kind: str, k: int) -> None:
        """Until the sampler has finished `kind` of iteration k (asked for before, or done already)."""
        if (kind, k) not in self.asked:
            return
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

    def drain(self) -> None:
        """Until everything asked for is done."""
        for kind, k in sorted(self.asked - self.done):
            self.wait(kind, k)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.conn.send(("stop", -1))
        except OSError:
            pass
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None


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


def serve(uri: str, conn, parent: int) -> None:
    """The sampler process: rollouts and evals as asked, one at a time, on one warm engine."""
    _die_with(parent)
    cpus = os.environ.get(SAMPLER_CPUS)
    if cpus:  # before torch starts: its thread pool is sized from this mask
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    from pipeline.eval.run import run_eval
    from pipeline.models.engines import cpu_env
    from pipeline.report import tracking
    from pipeline.schedule import iteration_plan
    from pipeline.rollout import engine_settings, policy_engine, run_rollout

    cpu_env()
    run = Run(uri)
    engine = None
    # the engine shares the machine with the trainer in the other process: sized as `iterate`
    # sizes its own (a GPU split that cannot fit is the one-line error, before any engine loads)
    settings = engine_settings(run, run.completed_iters(), shared=True)
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
                        engine = policy_engine(run, iteration_plan(run.cfg, k).behaviour, engine, settings=settings, where=f"rollout iteration {k}")
                        run_rollout(run, k, engine=engine)
                    elif kind == "eval" and not run.done(k, "eval"):
                        engine = policy_engine(run, k, engine, settings=settings, where=f"eval of policy {k}")
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
