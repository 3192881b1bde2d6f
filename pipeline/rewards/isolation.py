"""The sandbox's kernel side (see pipeline/rewards/sandbox.py): namespaces, mounts, a fresh uid
and resource limits for the child before it execs, and killing every process of that uid after.
Plain syscalls through libc (Python 3.11 has no os.unshare and no os.mount)."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import signal
import stat
import sys
from collections.abc import Callable
from typing import Literal

Isolation = Literal["namespaces", "userns", "prelude"]

MAX_PROCS = 16
"""RLIMIT_NPROC: processes + threads the code may have at once (the runner itself is one)."""
MAX_FILE_MB = 16
"""RLIMIT_FSIZE: largest file the code may write."""
MAX_OPEN_FILES = 64
"""RLIMIT_NOFILE."""

# ---------------------------------------------------------------------------------------- kernel
# unshare(2) and mount(2) through libc: Python 3.11 has no os.unshare and no os.mount.
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux/glibc: only the "prelude" mode remains
    _libc = None


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _closed_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` that other users cannot enter, or None."""
    current = "/"
    for part in path.strip("/").split("/")[:-1]:
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


@functools.cache
def _hidden_interpreter_dirs() -> tuple[tuple[str, str], ...]:
    """(directory, closed ancestor) for the interpreter's install and the venv when another
    user could not reach them, e.g. (('/root/.pyenv/versions/3.11.7', '/root'),)."""
    dirs = dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix))
    pairs = ((d, _closed_ancestor(d)) for d in dirs)
    return tuple((d, closed) for d, closed in pairs if closed is not None)


def _child_setup(mode: Isolation, uid: int, memory_mb: int, cpu_s: int) -> Callable[[], None]:
    """The preexec_fn: runs in the forked child, before exec. Plain syscalls only."""
    exposed = _hidden_interpreter_dirs()

    def setup() -> None:
        os.umask(0o022)
        if mode == "namespaces":
            _unshare(_CLONE_NEWNS | _CLONE_NEWNET)
            # Mounts below must not propagate back to the host's namespace.
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            # An interpreter under a closed directory (pyenv in /root): cover that directory
            # with an empty tmpfs and bind just the interpreter (and venv) back into it.
            keep = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d, _ in exposed]
            for closed in dict.fromkeys(closed for _, closed in exposed):
                _mount("tmpfs", closed, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755,size=1m")
            for (directory, _), fd in zip(exposed, keep):
                os.makedirs(directory, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", directory, None, _MS_BIND | _MS_REC)
                os.close(fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # drops every capability: from here on the kernel treats it as a stranger
        elif mode == "userns":
            _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        limits = {
            resource.RLIMIT_AS: memory_mb << 20,
            resource.RLIMIT_NPROC: MAX_PROCS,
            resource.RLIMIT_FSIZE: MAX_FILE_MB << 20,
            resource.RLIMIT_NOFILE: MAX_OPEN_FILES,
            resource.RLIMIT_CORE: 0,
        }
        for res, value in limits.items():
            resource.setrlimit(res, (value, value))
        # SIGXCPU at cpu_s, SIGKILL a second later if it is caught.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))

    return setup


def _kill_uid(uid: int) -> None:
    """SIGKILL every process running as `uid` (all of a "namespaces" sandbox, wherever it went).

    kill(-1) signals every process the caller may signal, i.e. those of its own uid; it is
    sent from a forked helper that has switched to that uid, repeated until none is left.
    """
    pid = os.fork()
    if pid == 0:  # the helper: syscalls only, then _exit
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(1000):
                os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            code = 0
        except BaseException:
            pass
        os._exit(code)
    os.waitpid(pid, 0)
