"""Policies whose weights file this process is still writing, in the background.

`iterate` publishes policy K+1 while rollout K+1 runs (pipeline.update.publish): the sampler gets
the weights in memory at once, and a thread computes the policy's sha256 in memory over the exact
bytes the file will hold, writes update K's MANIFEST.json (what says the update is done, naming
that hash), then the file, then the policy's MANIFEST.json (what says the policy is on disk).
Meanwhile `pipeline.run.run.Run` answers whether update K is done and policy K+1's hash once that
update manifest is written (`Pending.policy_hash`, `recorded`: nothing can name the hash before the
record holds it), and everything that reads the policy's files or asks whether it exists waits for
the whole write (`wait`). A kill before the update manifest leaves update K undone (it is run again,
from its stored parts); a kill after it and before the policy's manifest leaves the update done and
the policy missing: the next command re-runs that update from its stored parts and checks the hash
it recorded (`pipeline.update.publish.restore_policy`).

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
    thread: threading.Thread = field(init=False)
    error: BaseException | None = None
    recorded: threading.Event = field(default_factory=threading.Event)
    """Set once the policy's hash is in the record (the update's manifest), or the write failed."""
    values: dict = field(default_factory=dict)
    """What the write computes for readers in this process besides the file (`put`, `value`)."""
    _hash: str | None = None
    _over: bool = False
    _hooks: list = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def policy_hash(self) -> str:
        """The policy's hash, once the record names it (waits for that part of the write; raises its error)."""
        self.recorded.wait()
        if self._hash is None:  # the write failed before: its error, raised once (`wait`)
            wait(self.root, self.k)
            raise RuntimeError(f"policy {self.k}'s write ended without its hash")
        return self._hash

    def record(self, policy_hash: str) -> None:
        """The writer: the hash is in the record now (its readers go on, then `after_record`'s hooks run here)."""
        self._hash = policy_hash
        with self._changed:
            self.recorded.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def after_record(self, hook: Callable[[], None]) -> None:
        """`hook()` once the hash is in the record: on the writer's thread, or now if it is already
        (never if the write fails first). It must not raise."""
        with self._changed:
            if not self.recorded.is_set():
                self._hooks.append(hook)
                return
        if self._hash is not None:
            hook()

    def put(self, name: str, value) -> None:
        with self._changed:
            self.values[name] = value
            self._changed.notify_all()

    def value(self, name: str):
        """A value the write `put`, waited for; None if the write ended without it."""
        with self._changed:
            self._changed.wait_for(lambda: name in self.values or self._over)
            return self.values.get(name)

    def _ended(self) -> None:
        self.recorded.set()
        with self._changed:
            self._over = True
            self._changed.notify_all()


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


def start(root: str, k: int, write: Callable[[Pending], None], policy_hash: str | None = None) -> Pending:
    """Run `write(pending)` on a thread as the write of policy k of the run at (local) `root`; it
    calls `pending.record(hash)` once the record names the hash (given here as `policy_hash` if known)."""
    p = Pending(key(root), k)
    if policy_hash is not None:
        p.record(policy_hash)

    def body() -> None:
        try:
            write(p)
        except BaseException as e:  # raised again in whoever waits for the policy
            p.error = _one_line(p, e)
        finally:
            p._ended()

    # not a daemon: an interpreter that exits normally (also after an error) finishes the write first
    p.thread = threading.Thread(target=body, name=f"write policy {k}")
    with _LOCK:
        _PENDING[(p.root, k)] = p
    p.thread.start()
    return p


def _one_line(p: Pending, err: BaseException) -> BaseException:
    """The write's error as whoever waits raises it: a GRPOError (one line naming the policy's
    directory, the original kept as its cause for a debugger), a Ctrl-C or exit as it was."""
    from pipeline.errors import GRPOError
    from pipeline.store import policy_rel

    if isinstance(err, (GRPOError, KeyboardInterrupt, SystemExit)):
        return err
    first = (str(err).strip().splitlines() or [""])[0]
    one = GRPOError(f"{os.path.join(p.root, policy_rel(p.k))}: its background write failed: {type(err).__name__}: {first}")
    one.__cause__ = err
    return one


def get(root: str, k: int) -> Pending | None:
    """Policy k's write if it is still running (or finished and not yet waited for)."""
    return _PENDING.get((key(root), k)) if _PENDING else None


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


def wait_dir(path) -> None:
    """Return once policy directory `path` is whole where this process writes it in the background
    (at once otherwise); raise the write's error. What a rollout engine calls before it reads a
    policy's weights from its files (pipeline.rollout.policy_engine hands it over)."""
    if not _PENDING:
        return
    from pipeline.store import policy_rel

    real = os.path.realpath(path)
    for root, k in list(_PENDING):
        if os.path.join(root, policy_rel(k)) == real:
            wait(root, k)


def wait_all() -> None:
    """Every write this process started (the end of a command)."""
    for pr, _ in list(_PENDING):
        wait(pr)
