"""How many threads the update computes on, on a CPU (`update_threads`).

The demo's update (a 4M-parameter model, 4 optimizer steps over ~2.3k tokens) on torch's
default of one OpenMP thread per core: on a 2-core machine with other processes running, each
of the many small kernels of a forward and backward ends in a barrier where one thread waits
(spinning, then sleeping) for the other, which the OS has given to another process. Measured
in-process on the demo's update 0, on a machine shared with other work (load 11-30 on 2 cores):
2 threads took 67.9 s of CPU (288 s wall) where 1 thread took 7.4 s (43 s wall), with the same
weights to the bit. A tiny model's kernels gain little from a second thread even on an idle
machine (the tests run on one: tests/conftest.py), so without OMP_NUM_THREADS the update runs
on one thread; a user who sets OMP_NUM_THREADS (a big model on an idle many-core machine) gets
that count.
"""

from __future__ import annotations

import contextlib
import os

import torch

DEFAULT = 1
"""The update's threads on a CPU when OMP_NUM_THREADS is not set."""


def threads_for(device: torch.device) -> int | None:
    """The thread count the update sets on `device`, or None where it leaves torch's (a GPU, or
    OMP_NUM_THREADS set: torch already follows it)."""
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    return DEFAULT


@contextlib.contextmanager
def update_threads(device: torch.device):
    """torch's intra-op threads set to `threads_for(device)` inside, as they were afterwards.
    Through torch._C.set_num_threads (what torch.set_num_threads is): an in-process vLLM engine
    replaces torch.set_num_threads by a no-op that only warns (vllm/v1/worker/cpu_worker.py),
    and `iterate` trains beside one."""
    n = threads_for(device)
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
