"""Policies whose weights file this process is still writing, in the background.

`iterate` publishes policy K+1 while rollout K+1 runs (pipeline.update.publish): its sha256 is
computed in memory over the exact bytes the file will hold, the sampler gets the weights in
memory, and a thread writes the file, then the policy's MANIFEST.json (what says the policy is
on disk). Meanwhile `pipeline.run.run.Run` answers policy K+1's hash from here, and everything
that reads its files or asks whether it exists waits for the thread (`wait`). A kill before the
manifest leaves the update done and the policy missing: the next command re-runs that update
from its stored parts and checks the hash it recorded (`pipeline.update.publish.restore_policy`).

Other processes see no such policy until its manifest is written, so the write also holds a file
lock (`lock_rel`) from before the update's own lock is released until after the manifest: a second
process (a second `grpo iterate`, or `grpo update --iter K` as an error message suggests) that would
re-create the policy, or says its write was interrupted, tells a write still running elsewhere
from one a kill stopped (`held`, `hold`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Pending:
    """Policy `k` of the run at `root`, being written by `thread`."""

    root: str
    k: int
    policy_hash: str
    weights: dict
    """{name: tensor} the file will hold (the fp32 master: what an engine's probe is checked against)."""
    thread: threading.Thread = field(init=False)
    error: BaseException | None = None


_PENDING: dict[tuple[str, int], Pending] = {}
_LOCK = threading.Lock()


def lock_rel(k: int) -> str:
    """The lock a background write of policy k holds (beside, not in, the directory it completes)."""
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
    """Whether another process is writing policy k in the background now."""
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


def key(root: str) -> str:
    return os.path.realpath(root)


def start(root: str, k: int, policy_hash: str, weights: dict, write: Callable[[], None]) -> Pending:
    """Run `write` on a thread as the write of policy k of the run at (local) `root`."""
    p = Pending(key(root), k, policy_hash, weights)

    def body() -> None:
        try:
            write()
        except BaseException as e:  # raised again in whoever waits for the policy
            p.error = e

    # not a daemon: an interpreter that exits normally (also after an error) finishes the write first
    p.thread = threading.Thread(target=body, name=f"write policy {k}")
    with _LOCK:
        _PENDING[(p.root, k)] = p
    p.thread.start()
    return p


def get(root: str, k: int) -> Pending | None:
    """Policy k's write if it is still running (or finished and not yet waited for)."""
    return _PENDING.get((key(root), k))


def wait(root: str, k: int | None = None) -> None:
    """Return once policy k's write (every write of this run where k is None) is finished; raise its error."""
    r = key(root)
    for (pr, pk), p in list(_PENDING.items()):
        if pr == r and (k is None or pk == k):
            p.thread.join()
            with _LOCK:
                _PENDING.pop((pr, pk), None)
            if p.error is not None:
                raise p.error


def wait_all() -> None:
    """Every write this process started (the end of a command)."""
    for pr, _ in list(_PENDING):
        wait(pr)
