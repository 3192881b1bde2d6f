"""Third-party start-up chatter kept off the user's screen.

vLLM's CPU build logs a Triton note from its import and a NUMA-binding warning from C++ when the
engine starts, and DeepSpeed prints on stdout when it JIT-builds an op. None of it is about the
run, and it lands between the rows of the iteration table. `captured` sends the process's own
stdout and stderr (file descriptors 1 and 2, so C++ output too) to a temporary file for the
duration of a block and replays it only if the block fails. GRPO_VERBOSE=1 shows everything.
Ray's driver prints the cluster's notices on stdout: `ray_notices_to_stderr` sends them to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator


@contextlib.contextmanager
def captured() -> Iterator[None]:
    if os.environ.get("GRPO_VERBOSE"):
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(1), os.dup(2)
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed:  # what the library said is the user's only clue
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode(errors="replace"))
                sys.stderr.flush()


def ray_notices_to_stderr() -> None:
    """Ray's driver prints the cluster's notices ("(raylet) ... node marked dead", pushed to every
    driver by its error listener) on stdout, between the iteration table's rows: they go to stderr,
    with the run's own cluster lines. Through the one function that listener prints with (log_to_driver
    is off: it prints nothing else); a Ray without it prints as it does."""
    import ray._private.worker as ray_worker

    show = getattr(ray_worker, "print_to_stdstream", None)
    if show is None or getattr(show, "to_stderr", False):
        return

    def to_stderr(data, ignore_prefix):
        return show({**data, "is_err": True}, ignore_prefix)

    to_stderr.to_stderr = True
    ray_worker.print_to_stdstream = to_stderr
