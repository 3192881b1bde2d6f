"""The record of an update still being written: at most one per run, in this process.

`iterate` leaves policy k+1's record to a thread (the sampler takes the policy from the trainer's
memory with `rollout.weight_sync: memory`, or waits for its files with `disk`);
pipeline/update/record.py says in what order, and what a kill at each step leaves. While that
thread runs, the run holds one `Inflight`:
- `hash`: a future, settled once update k's MANIFEST.json names policy k+1's hash;
- `files`: a future, settled once the thread has ended: policy k+1's MANIFEST.json written (its
  files are whole) and older states and policies pruned (record.py's steps 7-8);
- `lock`: policy k+1's write lock (`lock_rel`), taken before update k's own lock is released and
  released by the thread after the policy's manifest: another process tells a write running here
  from one a kill stopped (`held`, `hold`).
A failed write settles both futures with its one-line error (`_one_line`), raised once, to the
first that settles `files` (`settle`). `pipeline.run.run.Run.settle` is how a reader waits
(tracking reads `Run.unwaited`, which never does).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

WHAT = ("hash", "files")


@dataclass
class Inflight:
    """Policy `k` of the run at `root`, being written by `thread`."""

    root: str
    k: int
    hash: Future = field(default_factory=Future)
    files: Future = field(default_factory=Future)
    thread: threading.Thread | None = None

    def record(self, policy_hash: str) -> None:
        """The writer: the hash is in the record now."""
        self.hash.set_result(policy_hash)


_RUNS: dict[str, Inflight] = {}
"""The one write in flight of each run of this process, by the run's real path."""


def key(root: str) -> str:
    return os.path.realpath(root)


def start(root: str, k: int, write: Callable[[Inflight], None], policy_hash: str | None = None) -> Inflight:
    """Run `write(inflight)` on a thread as the write of policy k of the run at (local) `root`; it
    calls `inflight.record(hash)` once the record names the hash (given here as `policy_hash` if
    known). A write of the run still in flight is settled first (its error raised)."""
    r = key(root)
    if r in _RUNS:
        settle(r, _RUNS[r].k, "files")
    p = Inflight(r, k)
    if policy_hash is not None:
        p.record(policy_hash)

    def body() -> None:
        try:
            write(p)
        except BaseException as e:  # raised again in whoever settles the policy
            err = _one_line(p, e)
            if not p.hash.done():
                p.hash.set_exception(err)
            p.files.set_exception(err)
        else:
            if not p.hash.done():
                p.hash.set_exception(RuntimeError(f"policy {k}'s write ended without its hash"))
            p.files.set_result(None)

    # not a daemon: an interpreter that exits normally (also after an error) finishes the write first
    p.thread = threading.Thread(target=body, name=f"write policy {k}")
    _RUNS[r] = p
    try:
        p.thread.start()
    except BaseException:  # no thread (no memory for one, a Ctrl-C): nothing in flight, nobody waits on it
        _RUNS.pop(r, None)
        raise
    return p


def get(root: str, k: int) -> Inflight | None:
    """Policy k's write if it is in flight (or finished and not yet settled). Never waits."""
    p = _RUNS.get(key(root)) if _RUNS else None
    return p if p is not None and p.k == k else None


def settle(root: str, k: int | None, what: str) -> str | None:
    """Wait for policy k's write of the run at `root` (k None: the run's write in flight, whichever),
    if one is in flight: "hash" until the record names its hash (returned), "files" until the
    policy's manifest is written (the write is then done with, its error raised once). At once
    where none is."""
    p = _RUNS.get(key(root)) if k is None else get(root, k)
    if p is None:
        return None
    k = p.k
    if what == "hash":
        try:
            return p.hash.result()
        except BaseException:  # the write failed before the record: its error, raised once
            settle(root, k, "files")
            raise
    if what != "files":
        raise ValueError(f"settle: {what!r} is not one of {WHAT}")
    try:
        p.files.result()
    finally:
        p.thread.join()
        if _RUNS.get(p.root) is p:
            _RUNS.pop(p.root, None)
    return p.hash.result() if not p.hash.exception() else None


def wait_dir(path) -> None:
    """Return once policy directory `path` is whole where this process writes it (at once
    otherwise); raise the write's error. What a rollout engine is handed, when it is made, to call
    before it reads a policy's weights from its files (pipeline.rollout.policy_engine)."""
    if not _RUNS:
        return
    from pipeline.store import policy_rel

    real = os.path.realpath(path)
    for p in list(_RUNS.values()):
        if os.path.join(p.root, policy_rel(p.k)) == real:
            settle(p.root, p.k, "files")


def _one_line(p: Inflight, err: BaseException) -> BaseException:
    """The write's error as whoever settles it raises it: a GRPOError (one line naming the policy's
    directory, the original kept as its cause for a debugger), a Ctrl-C or exit as it was."""
    from pipeline.errors import GRPOError
    from pipeline.store import policy_rel

    if isinstance(err, (GRPOError, KeyboardInterrupt, SystemExit)):
        return err
    first = (str(err).strip().splitlines() or [""])[0]
    one = GRPOError(f"{os.path.join(p.root, policy_rel(p.k))}: its background write failed: {type(err).__name__}: {first}")
    one.__cause__ = err
    return one


# -- the write lock: what another process sees of a write running here --------------------------
def lock_rel(k: int) -> str:
    """The lock a write of policy k holds (beside, not in, the directory it completes)."""
    return f"policy/.lock-iter-{k:04d}"


def _file_lock(root: str, k: int):
    import filelock

    # not thread-local: the main thread takes it, the writing thread releases it
    return filelock.FileLock(os.path.join(root, lock_rel(k)), timeout=0, thread_local=False)


def _busy(root: str, k: int) -> str:
    return (f"{os.path.join(root, lock_rel(k))}: another grpo process is writing policy {k} (its `grpo iterate`'s "
            f"background write); wait for it or stop it")


def acquire(root: str, k: int, wait: float = 0.0):
    """Policy k's write lock, held (release it with `.release()`, from any thread), else a one-line
    error. `wait`: seconds to wait for it (another process's `held` probe takes it for a moment)."""
    import filelock

    from pipeline.errors import GRPOError

    lk = _file_lock(root, k)
    try:
        lk.acquire(timeout=wait)
    except filelock.Timeout:
        raise GRPOError(_busy(root, k)) from None
    return lk


@contextlib.contextmanager
def hold(root: str, k: int, wait: float = 10.0):
    """Policy k's write lock for the block (a process re-creating the policy), else a one-line error.
    `wait`: a reader's probe holds it for a moment, and a write about to finish needs no re-creating."""
    lk = acquire(root, k, wait)
    try:
        yield
    finally:
        lk.release()


def held(root: str, k: int) -> bool:
    """Whether another process is writing policy k now."""
    import filelock

    if not os.path.isdir(os.path.join(root, "policy")):
        return False
    lk = _file_lock(root, k)
    try:
        lk.acquire()
    except filelock.Timeout:
        return True
    except OSError:  # a run this process may only read (a read-only copy being audited): nobody writes it there
        return False
    lk.release()
    return False
