"""Locks on a run directory: one process at a time per stage, shard, manifest or MLflow run.

A file lock (filelock) on a local disk; on an object store an `ObjectLock`, which also excludes
workers on other machines.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Iterator

from pipeline.errors import GRPOError

if TYPE_CHECKING:
    from pipeline.store import RunStore


@contextlib.contextmanager
def lock(store: "RunStore", rel: str, what: str, wait: float = 0.0) -> Iterator[None]:
    """Exclusive lock on `rel` of `store`; a second holder fails with a clear message (or waits)."""
    if not store.local:
        with ObjectLock(store, rel, what, wait):
            yield
        return
    import filelock

    lock_path = store.path(rel)
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    held = filelock.FileLock(lock_path, timeout=wait)
    try:
        held.acquire()
    except filelock.Timeout:
        raise GRPOError(f"{store.display(rel)}: another grpo process holds this lock ({what}); wait for it or stop it") from None
    try:
        yield
    finally:
        held.release()


LOCK_HEARTBEAT_S = 15.0
"""How often the holder of an object-store lock rewrites it (its heartbeat)."""

log = logging.getLogger("grpo.store")


def lock_stale_s() -> float:
    """Heartbeat age after which an object-store lock's holder counts as dead (GRPO_LOCK_STALE_S)."""
    return float(os.environ.get("GRPO_LOCK_STALE_S", "120"))


def _host_id() -> str:
    """This machine and pid namespace: a pid is only meaningful where the same ones are visible."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{ns}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class ObjectLock:
    """An exclusive lock on an object store, between processes on any number of machines.

    Taken by creating the lock object only if it is absent, a conditional PUT
    (`If-None-Match: *`) that S3 and S3-compatible servers apply atomically; released by
    deleting it. The holder rewrites it every LOCK_HEARTBEAT_S seconds. A holder is dead, and its
    lock is taken over, when it ran in this machine's pid namespace under a pid that is gone, or
    when its heartbeat is older than `lock_stale_s()` (the machines' clocks must agree to well
    within that). On S3 the take-over is a PUT conditional on the dead holder's ETag
    (`If-Match`), so of two workers breaking the same lock exactly one wins. Other fsspec stores
    get fsspec's create-if-absent, which is atomic only where their backend makes it so.
    """

    def __init__(self, store: "RunStore", rel: str, what: str, wait: float):
        self.store, self.rel, self.what, self.wait = store, rel, what, wait
        self.fs, self.path = store.fs, store.path(rel)
        protocols = store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)
        self.s3 = "s3" in protocols
        self.me = {"owner": uuid.uuid4().hex, "host": _host_id(), "pid": os.getpid(), "what": what}
        self.etag: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _put(self, **condition) -> None:
        out = self.fs.pipe_file(self.path, json.dumps({**self.me, "heartbeat": time.time()}).encode(), **condition)
        etag = out.get("ETag") if isinstance(out, dict) else None
        self.etag = etag or self.fs.info(self.path).get("ETag")

    def _holder(self) -> tuple[dict, str | None] | None:
        """The lock object's content and ETag (ETag first: a take-over conditional on it then
        fails if the content changed after it was read), or None when there is no lock."""
        try:
            etag = self.fs.info(self.path).get("ETag")
            holder = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # not ours: nobody alive holds it
            holder = {}
        return (holder if isinstance(holder, dict) else {}), etag

    def _dead(self, holder: dict) -> bool:
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"]):
            return True
        return time.time() - float(holder.get("heartbeat") or 0) > lock_stale_s()

    def _take_over(self, etag: str | None) -> bool:
        try:
            if self.s3 and etag:
                self._put(IfMatch=etag)
            else:
                self.fs.rm(self.path)
                self._put(mode="create")
        except OSError:  # another worker took it first (412 Precondition Failed, or gone)
            return False
        return True

    def __enter__(self) -> "ObjectLock":
        deadline = time.monotonic() + self.wait
        while True:
            try:
                self._put(mode="create")
                break
            except FileExistsError:
                pass
            found = self._holder()
            if found is None:
                continue  # released between the two requests
            holder, etag = found
            if self._dead(holder):
                log.warning("%s: taking over the lock of a dead holder (%s)", self.store.display(self.rel), holder)
                if self._take_over(etag):
                    break
                continue
            if time.monotonic() >= deadline:
                who = f"{holder.get('what', '?')}; pid {holder.get('pid')} on {str(holder.get('host')).split('|')[0]}"
                raise GRPOError(f"{self.store.display(self.rel)}: another grpo process holds this lock ({who}); wait for it or stop it")
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self._beat = threading.Thread(target=self._heartbeat, name="grpo-lock-heartbeat", daemon=True)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                self._put(**({"IfMatch": self.etag} if self.s3 and self.etag else {}))
            except OSError as err:  # unreachable, or taken over (this process was presumed dead)
                log.warning("%s: lock heartbeat failed: %s", self.store.display(self.rel), err)
                if err.errno == errno.EINVAL:  # s3fs's code for 412 Precondition Failed: not ours any more
                    return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with contextlib.suppress(OSError):
            found = self._holder()
            if found is not None and found[0].get("owner") == self.me["owner"]:
                self.fs.rm(self.path)
