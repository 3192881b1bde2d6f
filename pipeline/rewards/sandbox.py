"""Run model-written Python against assert-style test cases in a separate, limited process.

    run_python("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add(1, 1) == 3"])
    # SandboxResult(passed=1, total=2, status='ok', stderr_tail='test 1 failed (assert add(1, 1) == 3): AssertionError\n')

This is the `code_tests` reward's executor. The child is `python -I` (the pipeline's own
interpreter, isolated mode: no PYTHON* variables, no user site). It executes the code once,
then each test in its own try/except, so one failing assert does not hide the others, and
reports each outcome on a pipe of its own as a line prefixed by a random nonce: printing
"passed" does not count. The solution runs with `__name__ == "__solution__"`, so an
`if __name__ == "__main__":` demo block (which often waits on input()) is skipped. Its stdout
is discarded and stdin is empty; the tail of its stderr comes back in the result.

What every call gets, whatever the machine:
- a fresh working directory (also HOME and TMPDIR), deleted afterwards; a scrubbed environment;
- resource limits set before exec: address space (`memory_mb`), CPU seconds (`cpu_s`),
  processes/threads (MAX_PROCS), file size (MAX_FILE_MB), open files (MAX_OPEN_FILES), no core;
- a wall-clock deadline (`timeout_s`) after which the whole process group is SIGKILLed, and
  bounded reading of its output; the call always returns a SandboxResult.

What depends on `isolation()`, probed once per process (strongest first):
- "namespaces" (running as root, the case on this project's machines): the child gets its own
  network namespace (only a loopback that is down: nothing, not even 127.0.0.1, is reachable),
  its own mount namespace, and a fresh unused uid. Under that uid it cannot write files it does
  not own (the run directory, other users' directories), cannot signal other processes, and
  RLIMIT_NPROC counts its processes alone, which stops fork bombs (the kernel exempts uid 0 from
  that limit, hence the uid switch). After the call every process of that uid is killed, even
  ones that left the process group. If the interpreter lives under a directory other users
  cannot enter (pyenv under /root), that directory is replaced, in the child's mount namespace
  only, by an empty tmpfs holding just the interpreter: the rest of it (/root) is hidden.
- "userns" (not root, or root without the rights for the above, e.g. in a container, but with
  user namespaces): own user + network namespace, so no network; but the code runs as you: it
  can write and signal whatever you can, RLIMIT_NPROC counts all your processes (and binds
  root not at all), and what leaves the process group survives the call.
- "prelude" (neither): as "userns", and the network is only cut by patching `socket` before
  the code runs: that stops ordinary socket, urllib and http use, not ctypes or a subprocess.

Never guaranteed: reading world-readable files (/etc, the venv, a world-readable run
directory), writing world-writable places (/tmp, /dev/shm; each file capped at MAX_FILE_MB),
and honest tests. The tests run in the solution's own process, so code written to game them
(objects whose __eq__ is always True, patched builtins) passes them; the nonce only stops
printed, forged results. Run untrusted code at scale in a container or VM as well.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from pipeline.errors import GRPOError
from pipeline.rewards.isolation import Isolation, _child_setup, _kill_uid, _libc  # the limits MAX_* live there too

Status = Literal["ok", "error", "timeout", "crashed"]
STDERR_TAIL_CHARS = 2000
"""How much of the child's stderr a SandboxResult keeps (the end, where the error is)."""
_RESULT_CAP = 1 << 20  # bytes read from the result pipe; real reports are ~40 bytes per test
_UID_BASE, _UID_SPAN = 1_600_000_000, 500_000_000  # fresh uids, far above any real account


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    """Tests whose code ran without raising."""
    total: int
    """Tests given."""
    status: Status
    """ok: every test ran; error: the code itself raised (tests not run); timeout: the deadline
    hit first; crashed: the process died before reporting every test (a limit, os._exit, ...)."""
    stderr_tail: str
    """The end of the child's stderr: the solution's error or the first failing tests."""

    @property
    def score(self) -> float:
        """Fraction of tests passed (0 when there are none)."""
        return self.passed / self.total if self.total else 0.0


# The trusted part of the child. It takes what it needs (exec, os.write, ...) into locals
# before the solution runs, so the solution rebinding builtins or module attributes cannot
# change what gets reported; reports are plain text, no json on the way out.
_RUNNER = r"""
import json, os, sys

def block_network():
    import socket, _socket
    def refuse(*args, **kwargs):
        raise OSError(101, "network access is disabled in the sandbox")
    for name in ("connect", "connect_ex", "sendto", "sendmsg"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse
    _socket.socket = socket.socket

def main(job):
    fd, nonce, code, tests = job["fd"], job["nonce"], job["code"], job["tests"]
    write, run, build, numbered, Failure = os.write, exec, compile, enumerate, BaseException
    err_write = sys.stderr.write
    def report(line):
        write(fd, (nonce + " " + line + "\n").encode())
    def note(text, err):
        try:
            detail = str(err)
            err_write(f"{text}: {type(err).__name__}{': ' if detail else ''}{detail}\n")
        except Failure:
            pass
    if job["block_network"]:
        block_network()
    namespace = {"__name__": "__solution__"}
    try:
        run(build(code, "<solution>", "exec"), namespace)
    except Failure as err:
        note("solution failed", err)
        report("error")
        return
    for i, test in numbered(tests):
        try:
            run(build(test, f"<test {i}>", "exec"), namespace)
            ok = 1
        except Failure as err:
            note(f"test {i} failed ({test[:80]})", err)
            ok = 0
        report(f"test {i} {ok}")
    report("done")

payload = sys.stdin.buffer.read()
sys.stdin = open(os.devnull)
main(json.loads(payload))
"""

# ------------------------------------------------------------------------------------------- run


def _collect(proc: subprocess.Popen, result_fd: int, deadline: float) -> tuple[bytes, bytes, bool]:
    """Read the result pipe (head kept) and stderr (tail kept) until both close or the deadline.

    Returns (results, stderr, timed_out). A child that exited while something it left behind
    still holds the pipes open is given 0.2 s, then abandoned.
    """
    bufs = {"result": bytearray(), "stderr": bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(result_fd, selectors.EVENT_READ, "result")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    exited_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return bytes(bufs["result"]), bytes(bufs["stderr"]), True
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.data]
                if key.data == "result":
                    buf += chunk[: max(0, _RESULT_CAP - len(buf))]
                else:
                    buf += chunk
                    del buf[: max(0, len(buf) - 4 * STDERR_TAIL_CHARS)]
    finally:
        sel.close()
    return bytes(bufs["result"]), bytes(bufs["stderr"]), False


def _parse(results: bytes, nonce: str, total: int) -> tuple[int, bool, bool]:
    """(passed, code_raised, done) from the nonce-prefixed report lines."""
    outcome: dict[int, bool] = {}
    raised = done = False
    for line in results.decode("utf-8", "replace").splitlines():
        head, _, rest = line.partition(" ")
        if head != nonce:
            continue
        words = rest.split()
        if words == ["error"]:
            raised = True
        elif words == ["done"]:
            done = True
        elif len(words) == 3 and words[0] == "test" and words[1].isdigit() and words[2] in ("0", "1"):
            i = int(words[1])
            if i < total:
                outcome.setdefault(i, words[2] == "1")
    return sum(outcome.values()), raised, done


def _run(mode: Isolation, code: str, tests: list[str], timeout_s: float, memory_mb: int, cpu_s: int) -> SandboxResult:
    nonce = secrets.token_hex(16)
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    result_r, result_w = os.pipe()
    proc = None
    try:
        if mode == "namespaces":
            os.chown(workdir, uid, uid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        env["OMP_NUM_THREADS"] = "1"
        job = {"fd": result_w, "nonce": nonce, "code": code, "tests": tests, "block_network": mode == "prelude"}
        deadline = time.monotonic() + timeout_s
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            cwd=workdir, env=env, pass_fds=(result_w,), start_new_session=True,
            preexec_fn=_child_setup(mode, uid, memory_mb, cpu_s),
        )  # fmt: skip
        os.close(result_w)
        result_w = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:  # died at once; its stderr says why
            pass
        results, stderr, timed_out = _collect(proc, result_r, deadline)
    finally:
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the session: the child and what it forked
            except (ProcessLookupError, PermissionError):
                pass
            if mode == "namespaces":
                _kill_uid(uid)
            proc.wait()
            proc.stderr.close()
        for fd in (result_r, result_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    passed, raised, done = _parse(results, nonce, len(tests))
    status: Status = "ok" if done else "error" if raised else "timeout" if timed_out else "crashed"
    tail = stderr.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:]
    return SandboxResult(passed=passed, total=len(tests), status=status, stderr_tail=tail)


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation mode that works here (probed once per process; see the module doc)."""
    modes: list[Isolation] = ["prelude"]
    if _libc is not None:
        modes.insert(0, "userns")
        if os.geteuid() == 0:
            modes.insert(0, "namespaces")
    problems = []
    for mode in modes:
        try:
            probe = _run(mode, "x = 1", ["assert x == 1"], timeout_s=30.0, memory_mb=512, cpu_s=30)
        except (OSError, subprocess.SubprocessError) as err:
            problems.append(f"{mode}: {err}")
            continue
        if probe.passed == 1 and probe.status == "ok":
            return mode
        problems.append(f"{mode}: {probe.status} {probe.stderr_tail.strip()[-200:]}")
    raise GRPOError(f"sandbox: cannot run Python in a child process ({'; '.join(problems)})")


def run_python(
    code: str,
    tests: list[str],
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    cpu_s: int | None = None,
) -> SandboxResult:
    """Run `code`, then each assert-style test in `tests`, in a sandboxed `python -I`.

    timeout_s is wall-clock for the whole call (startup included); cpu_s (default: timeout_s
    rounded up, plus 1) bounds CPU time per process; memory_mb bounds the address space.
    Never raises for anything the code does; GRPOError only if no child can be started.
    """
    if cpu_s is None:
        cpu_s = math.ceil(timeout_s) + 1
    mode = isolation()
    try:
        return _run(mode, code, list(tests), timeout_s, memory_mb, cpu_s)
    except (OSError, subprocess.SubprocessError) as err:  # e.g. fork failing for lack of memory
        raise GRPOError(f"sandbox ({mode}): cannot start a child process ({err})") from err
