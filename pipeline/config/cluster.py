"""The `cluster:` section of the run's configuration: where `grpo iterate` runs its stages.

Where the stages run is not what they compute: a Ray run writes the bytes a local run writes, so
this section stays out of the config hash (`pipeline.config.canonical`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from pipeline.config.base import Section


class ClusterConfig(Section):
    """How `grpo iterate` runs: in this process, or on a Ray cluster (docs/scale-out.md)."""

    executor: Literal["local", "ray"] = "local"
    """local: every stage in the `grpo iterate` process; ray: rollout parts on Ray actors and score parts as Ray tasks
    (`pip install -e ".[ray]"`), logprobs in the `grpo iterate` process (the driver), the update there too or, with
    update_workers > 1, on that many Ray-placed processes."""
    address: str | None = None
    """The Ray cluster to join, e.g. 127.0.0.1:6379 (`ray start --head` prints it); None: RAY_ADDRESS, else a Ray
    instance started on this machine for the run. A secret in it (`ray://user:${RAY_PASSWORD}@host:10001`) is written
    `${NAME}`, read from the environment where the driver joins and never stored."""

    @field_validator("address")
    @classmethod
    def _no_secret_written(cls, value: str | None, info: ValidationInfo) -> str | None:
        from pipeline.config.urls import checked_location

        return value if value is None else checked_location(value, info.context)
    rollout_workers: int = Field(1, ge=1)
    """Rollout actors, one engine each, kept warm across iterations."""
    rollout_cpus: float = Field(1.0, gt=0)
    """CPUs each rollout actor reserves (its engine's threads: the whole number of them, at least 1)."""
    rollout_gpus: float = Field(0.0, ge=0)
    """GPUs each rollout actor reserves (1 on a GPU cluster)."""
    score_cpus: float = Field(1.0, gt=0)
    """CPUs each score task reserves (one task per part)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long the driver waits for a rollout actor to start (placed, engine libraries imported) before it gives up."""
    part_timeout_s: float = Field(3600.0, gt=0)
    """How long one rollout part may take on its actor, and a score task to be placed and run (with start_timeout_s
    besides), before the driver stops with a line naming the part; separate from start_timeout_s, so a long part is not
    cut at the start timeout."""
    place_timeout_s: float = Field(300.0, gt=0)
    """How long score tasks or update processes may fit on no node alive (a node lost for good, even with every idle
    rollout actor stopped to make room) before the driver stops with a line saying what cannot be placed; a node that
    joins within it takes the work."""
    update_workers: int = Field(1, ge=1)
    """1: the update runs in the driver with its warm trainer. N > 1: N processes placed by Ray (one placement-group
    bundle of update_cpus/update_gpus each), each running `grpo update RUN --iter K` with the launcher's variables
    set as torchrun sets them (gloo on CPUs, NCCL on GPUs): data-parallel DeepSpeed, the same code and resume points."""
    update_cpus: float = Field(1.0, gt=0)
    """CPUs each update process reserves (its threads: the whole number of them, at least 1)."""
    update_gpus: float = Field(0.0, ge=0)
    """GPUs each update process reserves (1 on a GPU cluster: Ray makes it the only one the process sees)."""
