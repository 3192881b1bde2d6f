"""The trainer's process group and DeepSpeed config.

Under a launcher (`deepspeed`, `torchrun`) the launcher's variables say who this process is.
Without one, `init_distributed` makes a one-process group (gloo on CPUs, NCCL on GPUs) from
variables it sets only for as long as the group takes to form, and then puts os.environ back:
a process this one starts later (a `grpo` command, a reward sandbox) sees no launcher and does
not try to bind the port this group holds. DeepSpeed's engine itself reads LOCAL_RANK while it
starts and (ZeRO-3) while it trains, so the trainer's DeepSpeed calls run inside
`deepspeed_env`, which sets that one variable around them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket

from pipeline.errors import GRPOError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> bool:
    """Whether a launcher started this process (it set RANK)."""
    return "RANK" in os.environ


@contextlib.contextmanager
def _set_for_now(values: dict[str, str]):
    """os.environ with `values` set inside; each variable as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_distributed(device=None) -> tuple[int, int]:
    """Join the launcher's process group, or make a one-process group without one (the backend
    as `device_budget.dist_backend` says for `device`, default this machine's). Returns (rank, world)."""
    import deepspeed
    import torch

    from pipeline.models.device_budget import dist_backend, this_device
    from pipeline.quiet import captured

    device = device or this_device()
    if not device.cuda:
        _no_shm_comm_op()  # before DeepSpeed's backend starts, here or in deepspeed.initialize
    if not torch.distributed.is_initialized():
        own = {} if launched() else dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        # no launcher: without these DeepSpeed would try MPI discovery and fail
        with _set_for_now(own), captured():
            deepspeed.init_distributed(dist_backend=dist_backend(device))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def local_rank_env():
    """LOCAL_RANK set inside where no launcher set it (the group is, or will be, this process's
    own): DeepSpeed's engine reads it from os.environ as it starts and (ZeRO-3) as it trains."""
    own = {"LOCAL_RANK": "0"} if not launched() and "LOCAL_RANK" not in os.environ else {}
    with _set_for_now(own):
        yield


def deepspeed_env(fn):
    """`fn` (a trainer method calling DeepSpeed) run inside `local_rank_env`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with local_rank_env():
            return fn(*args, **kwargs)

    return wrapper


def close_distributed() -> None:
    """Multi-process ZeRO-3 aborts at exit unless ranks meet and the group is torn down. Through
    DeepSpeed, which then drops the groups it derived from this one: torn down behind its back,
    its next engine in this process (a second `iterate`) would use them and fail."""
    import sys

    import torch

    if torch.distributed.is_initialized():
        import deepspeed.comm

        barrier()
        deepspeed.comm.destroy_process_group()
        return
    # the group is already gone (in `iterate`, vLLM's engine closed the group it made and the
    # trainer joined): DeepSpeed still holds the groups it derived from it
    release = getattr(sys.modules.get("deepspeed.utils.groups"), "_release_process_group_references", None)
    if release is not None:
        release(group=None)


def barrier() -> None:
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def is_rank_zero() -> bool:
    """Whether this process is rank 0: the one that holds the locks, publishes and reports. The
    process group's rank once one exists; before, the launcher's RANK (none: rank 0)."""
    import sys

    dist = getattr(sys.modules.get("torch"), "distributed", None)  # torch is not imported for it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _no_shm_comm_op() -> None:
    """On a CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
    (g++ for 100-200 s in the first process of an environment; every later process checks and
    loads it) that serves only its inference all-reduce: training reduces over gloo. Marked
    unavailable, it is neither built nor loaded, so the first update of a new environment no
    longer stalls for minutes, nor does its process do anything the later ones do not."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(cfg, world: int) -> dict:
    """DeepSpeed's config for the run's `train` settings over `world` processes."""
    t = cfg.train
    micro = t.mini_batch_size // t.grad_accum
    if micro % world:
        raise GRPOError(f"train.mini_batch_size / grad_accum ({micro}) must be divisible by the {world} processes")
    return {
        "train_micro_batch_size_per_gpu": micro // world,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.max_grad_norm,
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: avoids a 30-50 s JIT build of FusedAdam on the CPU
            "params": {"lr": t.lr, "betas": list(t.betas), "eps": 1e-8, "weight_decay": t.weight_decay, "torch_adam": True},
        },
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
