"""Progress of long loops: a rich bar on a terminal, plain log lines elsewhere (CI logs)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

PLAIN_EVERY_S = 10.0


class _Plain:
    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0
        self.t0 = self.last = time.time()

    def advance(self, n: int = 1) -> None:
        """A line every PLAIN_EVERY_S seconds, and a last one if any was printed: a loop shorter
        than that prints nothing, so the iteration table stays readable in a CI log."""
        self.done += n
        now = time.time()
        if now - self.last >= PLAIN_EVERY_S or (self.done == self.total and self.last > self.t0):
            self.last = now
            print(f"{self.label}: {self.done}/{self.total} ({now - self.t0:.0f}s)", file=sys.stderr, flush=True)


class _Rich:
    def __init__(self, progress, task):
        self.progress, self.task = progress, task

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


@contextlib.contextmanager
def progress(label: str, total: int) -> Iterator[_Plain | _Rich]:
    """`with progress("rollout iteration 3", parts) as p: ... p.advance()`."""
    if not sys.stderr.isatty():
        yield _Plain(label, total)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as p:
        yield _Rich(p, p.add_task(label, total=total))
