"""The driver's rollout actors: started once, kept warm, handed parts one at a time; a part whose
actor dies (killed, or its node lost) goes back to the queue and is re-run on whichever actor is
free, writing the same bytes."""

from __future__ import annotations

import os
from collections import deque
from typing import Callable

from pipeline.errors import GRPOError
from pipeline.store.faults import fault_point
from pipeline.cluster.workers import RolloutWorker


def raise_task_error(err, what: str):
    """A worker's own error (a GRPOError: one line) as the driver's; anything else as Ray gives it."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, GRPOError):
        raise GRPOError(str(cause)) from None
    raise GRPOError(f"{what}: {str(cause or err).strip().splitlines()[-1]}") from err


class RolloutPool:
    def __init__(self, run_uri: str, cc, probe: str, token: str, log: Callable[[str], None], status=None):
        import ray

        self.cc, self.log, self.probe, self.token, self.status = cc, log, probe, token, status
        self.cls = ray.remote(RolloutWorker).options(num_cpus=cc.rollout_cpus, num_gpus=cc.rollout_gpus, max_restarts=0,
                                                   scheduling_strategy="SPREAD")  # one per node where it can
        self.args = (run_uri, max(1, int(cc.rollout_cpus)))
        self.idle: list = []  # ready actors with nothing to do
        self.where: dict = {}  # actor -> {node, host, pid}
        self.starting: dict = {}  # its ready() reference -> actor
        self.inflight: dict = {}  # rollout_part reference -> (actor, part)
        for _ in range(cc.rollout_workers):
            self._start()
        while self.starting:  # every actor passes its checks before any work starts
            self._wait_one()

    def _start(self) -> None:
        actor = self.cls.remote(*self.args)
        self.starting[actor.ready.remote(self.probe, self.token)] = actor

    def alive(self) -> int:
        return len(self.idle) + len(self.starting) + len(self.inflight)

    def _top_up(self) -> None:
        """Replace a lost actor where the cluster has room for it now and for a score task besides (a
        lost node's room does not come back; an actor holds its CPUs, and the score tasks need some)."""
        import ray

        room = ray.available_resources().get("CPU", 0) >= self.cc.rollout_cpus + self.cc.score_cpus
        if self.alive() < self.cc.rollout_workers and room:
            self._start()

    def _wait_one(self):
        import ray

        waiting = list(self.inflight) + list(self.starting)
        if not waiting:
            raise GRPOError("cluster: no rollout worker is left (every actor died and the cluster has no room for a new one)")
        done, _ = ray.wait(waiting, num_returns=1, timeout=self.cc.start_timeout_s)
        if not done:
            raise GRPOError(f"cluster: no rollout worker started or finished a part in {self.cc.start_timeout_s:.0f} s "
                            f"(cluster.start_timeout_s); the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs, "
                            f"{self.cc.rollout_workers} rollout workers want {self.cc.rollout_cpus:g} each")
        ref = done[0]
        if ref in self.starting:
            actor = self.starting.pop(ref)
            try:
                self.where[actor] = ray.get(ref)
                self.idle.append(actor)
            except ray.exceptions.RayTaskError as err:
                raise_task_error(err, "rollout worker start")
            except ray.exceptions.RayError as err:  # died while starting: its node went away
                self.log(f"cluster: a rollout worker died while starting ({type(err).__name__})")
            return None
        return ref

    def run(self, k: int, parts: list[int], stamp: str) -> list[dict]:
        """Write rollout parts `parts` of iteration k over the actors; one report per part."""
        import ray

        queue, reports = deque(parts), []
        self._top_up()
        while queue or self.inflight:
            while queue and self.idle:
                actor, part = self.idle.pop(0), queue.popleft()
                self.inflight[actor.rollout_part.remote(k, part, stamp)] = (actor, part)
            self.show(k, len(queue))
            ref = self._wait_one()
            if ref is None:
                continue
            actor, part = self.inflight.pop(ref)
            try:
                reports.append(ray.get(ref))
                self.idle.append(actor)
                fault_point("rollout:part", k)  # the resume tests' hook: the driver dies with parts in flight
            except ray.exceptions.RayTaskError as err:
                raise_task_error(err, f"rollout iteration {k} part {part}")
            except ray.exceptions.RayError as err:  # the actor's process or node died: the part goes again
                w = self.where.pop(actor, {})
                self.log(f"rollout iteration {k} part {part}: its worker (node {w.get('node', '?')}, pid {w.get('pid', '?')}) "
                         f"died ({type(err).__name__}); the part is re-run")
                ray.kill(actor, no_restart=True)
                queue.appendleft(part)
                self._top_up()
        self.show(k, 0)
        for ref, actor in list(self.starting.items()):  # a replacement still starting would take CPUs the score tasks need
            ray.kill(actor, no_restart=True)
            del self.starting[ref]
        return reports

    def show(self, k: int, queued: int) -> None:
        """What `grpo status` shows while the driver runs: the parts in flight and the node of each."""
        if self.status is not None:
            parts = {str(p): self.where.get(a, {}).get("node", "?") for a, p in self.inflight.values()}
            self.status({"stage": "rollout", "iteration": k, "in_flight": parts, "queued": queued})

    def nodes(self) -> list[str]:
        return sorted({w["node"] for w in self.where.values()})

    def close(self) -> None:
        import ray

        for actor in [*self.idle, *self.starting.values(), *(a for a, _ in self.inflight.values())]:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # closing is best effort: the actor goes with the driver anyway
                pass
            ray.kill(actor, no_restart=True)


def forwarded_env() -> dict[str, str]:
    """The driver's settings the workers need (GRPO_*, HF_*, VLLM_*, ...), but for its own fault hook."""
    keep = ("GRPO_", "HF_", "VLLM_", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
    return {k: v for k, v in os.environ.items() if k.startswith(keep) and k != "GRPO_FAULT"}
