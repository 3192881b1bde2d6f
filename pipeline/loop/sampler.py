"""The sampler interface of `pipeline.loop.iterate`'s one loop, written once: what the loop asks of
whoever runs its rollouts and evals. Three samplers declare it: `InlineSampler` (this process, on the
warm engine: pipeline/loop/iterate.py), `ProcessSampler` (a process running ahead with
train.max_staleness: pipeline/loop/overlap.py) and `RaySampler` (a Ray cluster's actors:
pipeline/cluster/executor.py). It imports only abc and typing, so the cluster declares it without
loading the loop."""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol


class Sampler(Protocol):
    """Every method abstract: a sampler that declares the interface and leaves one out cannot be made."""

    @abstractmethod
    def ask(self, kind: str, k: int) -> None:
        """Start (or run) the `kind` ("rollout" or "eval") of iteration k, unless it is done."""

    @abstractmethod
    def wait(self, kind: str, k: int) -> None:
        """Return once the `kind` of iteration k asked for is written; raise its error if it failed."""

    @abstractmethod
    def drain(self) -> None:
        """Return once nothing asked for is still running."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the sampler started (processes, actors). The loop calls it at its end and again
        as it unwinds (its `finally`): a second call does nothing."""

    @abstractmethod
    def score(self, k: int) -> None:
        """Iteration k's score stage (its rollout is done)."""

    @abstractmethod
    def update(self, k: int) -> bool:
        """Whether the sampler ran iteration k's update itself (False: the loop's warm trainer does)."""

    @abstractmethod
    def figures(self, k: int) -> dict:
        """What iteration k's summary row gains from the sampler (e.g. the Ray cluster's straggler, workers)."""
