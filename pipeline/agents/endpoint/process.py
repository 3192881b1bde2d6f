"""The agent program of one episode (rollout.agent.command): checked at `grpo init`, started with
the endpoint's address, the episode's key and its task in its environment, killed past its timeout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.agents.endpoint.result import RESULT_ENV, read_result
from pipeline.errors import GRPOError

PYTHONS = ("python", "python3")
"""Names that mean the interpreter running grpo (its venv has the openai package)."""


def command(cmd: list[str]) -> list[str]:
    return [sys.executable if i == 0 and c in PYTHONS else c for i, c in enumerate(cmd)]


def check_command(cmd: list[str]) -> None:
    """One line naming rollout.agent.command when its program or a script it names does not exist."""
    exe = cmd[0]
    if exe not in PYTHONS and shutil.which(exe) is None and not Path(exe).is_file():
        raise GRPOError(f"rollout.agent.command: {exe!r} is not a program on PATH or a file")
    for arg in cmd[1:]:
        if arg.endswith(".py") and not Path(arg).is_file():
            raise GRPOError(f"rollout.agent.command: {arg!r}: no such file (relative paths are read from the directory grpo runs in)")


def stamp(cmd: list[str]) -> dict:
    """What the rollout's parts are stamped with: the command and the sha256 of each file it names,
    so a changed agent rewrites an unfinished rollout's parts instead of mixing them."""
    files = {a: hashlib.sha256(Path(a).read_bytes()).hexdigest() for a in cmd if Path(a).is_file() and a not in PYTHONS}
    return {"command": list(cmd), "files": files}


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (psutil's process tree): a child that started a session of its
    own (verifiers' subprocess runtime starts each harness program so) is outside the agent's group, and
    once the agent dies it is the init process's, out of reach."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def pieces(secret: str, n: int) -> set[str]:
    """Every run of `n` characters of `secret`, lower case (none for an empty secret)."""
    return {secret[i:i + n].lower() for i in range(len(secret) - n + 1)} if secret else set()


class AgentProcess:
    """One episode's agent: its own process group, stdout and stderr kept in a temporary file."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout_s: float):
        self.dir = Path(tempfile.mkdtemp(prefix="grpo-agent-"))
        self.result_path = self.dir / "result.json"
        self.log = open(self.dir / "output.txt", "wb")
        full = {**os.environ, **env, RESULT_ENV: str(self.result_path)}
        self.proc = subprocess.Popen(command(cmd), env=full, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.left = timeout_s  # seconds of its own time left: the clock runs except while a turn of its waits (hold/go)
        self.since: float | None = time.monotonic()
        self.killed = False

    def poll(self) -> int | None:
        return self.proc.poll()

    def hold(self, at: float) -> None:
        """Its request arrived at `at` (monotonic): from then until `go`, the engine's time, not the agent's."""
        if self.since is not None:
            self.left -= max(0.0, at - self.since)
            self.since = None

    def go(self) -> None:
        """Its request was answered: its own clock runs again."""
        if self.since is None:
            self.since = time.monotonic()

    def expired(self, at: float | None = None) -> bool:
        """Its own time used up by `at` (monotonic; now by default)."""
        return self.since is not None and (time.monotonic() if at is None else at) - self.since > self.left

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.killed = True
            below = descendants(self.proc.pid)  # before the kill: its children in sessions of their own too
            for pid, kill in [(self.proc.pid, os.killpg), *((p, os.kill) for p in below)]:
                try:
                    kill(pid, signal.SIGKILL)  # its own group (start_new_session), then each process below it
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc.wait()

    def result(self, secret: str = "") -> tuple[dict | None, str | None]:
        """What it wrote to GRPO_RESULT_FILE (pipeline.agents.endpoint.result): (result, None) or (None, why not);
        a result (or the reason it is none) that holds `secret`, the episode's key, or 12 characters of it, is refused."""
        result, why = read_result(self.result_path)
        text = json.dumps([result, why], ensure_ascii=False).lower()  # pieces of 12: a hex hash there never matches by chance
        if any(piece in text for piece in pieces(secret, 12)):
            return None, "the result file holds the episode's API key (OPENAI_API_KEY), which is never recorded"
        return result, why

    def output_tail(self, secret: str, lines: int = 5) -> str:
        """The last lines it printed (for the log, never the record), every piece of 6 or more of the episode's
        key's characters blanked out, so a key printed in parts (or in another case) is no more in the log."""
        self.log.flush()
        text = "\n".join((self.dir / "output.txt").read_text(errors="replace").splitlines()[-lines:])
        low, hide = "".join(c.lower() if c.isascii() else c for c in text), bytearray(len(text))  # as long as text
        for piece in pieces(secret, 6):
            at = low.find(piece)
            while at >= 0:
                hide[at:at + 6] = b"\1" * 6
                at = low.find(piece, at + 1)
        return "".join("*" if h else c for c, h in zip(text, hide))

    def cleanup(self) -> None:
        self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
