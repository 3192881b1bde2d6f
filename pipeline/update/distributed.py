"""The update's process group: the launcher's (`deepspeed` / `torchrun`), or a one-process gloo
group made here when there is none."""

from __future__ import annotations

import os
import socket

import torch

from pipeline.quiet import captured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_OWN_ENV: dict[str, str] = {}
"""The launcher variables `init_distributed` set itself (no launcher); `Trainer.close` takes them back."""


def init_distributed() -> tuple[int, int]:
    """Join the launcher's process group, or make a one-process gloo group without one."""
    import deepspeed

    if "RANK" not in os.environ:  # no launcher: DeepSpeed would try MPI discovery and fail
        _OWN_ENV.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        os.environ.update(_OWN_ENV)
    if not torch.cuda.is_available():
        _no_shm_comm_op()  # before DeepSpeed's backend starts, here or in deepspeed.initialize
    if not torch.distributed.is_initialized():
        with captured():
            deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _no_shm_comm_op() -> None:
    """On a CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
    (g++ for 100-200 s in the first process of an environment; every later process checks and
    loads it) that serves only its inference all-reduce: training reduces over gloo. Marked
    unavailable, it is neither built nor loaded, so the first update of a new environment no
    longer stalls for minutes, nor does its process do anything the later ones do not."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
