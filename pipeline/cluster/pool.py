"""The driver's rollout actors: started once, kept warm, handed parts one at a time; a part whose
actor dies (killed, or its node lost) goes back to the queue and is re-run on whichever actor is
free, writing the same bytes."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from pipeline.errors import GRPOError
from pipeline.store.faults import fault_point
from pipeline.cluster.placement import (Deadlines, actors_to_stop, alive_nodes, bundles_line, describe, free_nodes, held_elsewhere,
                                        room_for)
from pipeline.cluster.secrets import secrets_left_out
from pipeline.cluster.workers import RolloutWorker


def raise_task_error(err, what: str):
    """A worker's own error (a GRPOError: one line) as the driver's; anything else as Ray gives it."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, GRPOError):
        raise GRPOError(str(cause)) from None
    raise GRPOError(f"{what}: {str(cause or err).strip().splitlines()[-1]}") from err


CLOSE_S = 30.0
POLL_S = 2.0  # how often a stage waiting on Ray looks again at the nodes alive (make_room, Room)
RESUME = "the same `grpo iterate` command resumes the run from the parts written"


def wait_for_room(cc, log: Callable[[str], None]) -> None:
    """The nodes could hold the run (preflight); wait until what they have free now does: another run
    on the cluster holds its actors' CPUs from its first iteration to its last. One line when it does
    not fit, and a stop once cluster.place_timeout_s has passed so (the actors would otherwise wait
    for Ray to place them until cluster.start_timeout_s, saying nothing)."""
    import ray
    from ray._private.state import available_resources_per_node  # what Ray's own ray.util uses per node

    since = None
    while (line := held_elsewhere(free_nodes(ray.nodes(), available_resources_per_node()), alive_nodes(ray.nodes()), cc)) is not None:
        now = time.monotonic()
        if since is None:
            since = now
            log(f"{line}; waiting up to {cc.place_timeout_s:g} s (cluster.place_timeout_s)")
        if now - since >= cc.place_timeout_s:
            raise GRPOError(f"{line}, for {cc.place_timeout_s:g} s (cluster.place_timeout_s); once it is done, {RESUME}")
        time.sleep(POLL_S)


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
        self.deadlines = Deadlines()  # each start within cluster.start_timeout_s, each part within part_timeout_s
        wait_for_room(cc, log)  # another run on the cluster may hold it
        for _ in range(cc.rollout_workers):
            self._start()
        while self.starting:  # every actor passes its checks before any work starts
            self._wait_one()

    def _start(self) -> None:
        actor = self.cls.remote(*self.args)
        ref = actor.ready.remote(self.probe, self.token, secrets_left_out())
        self.starting[ref] = actor
        self.deadlines.start(ref, self.cc.start_timeout_s, f"cluster: a rollout worker did not start in {self.cc.start_timeout_s:g} s "
                             f"(cluster.start_timeout_s: placed, engine libraries imported)")

    def alive(self) -> int:
        return len(self.idle) + len(self.starting) + len(self.inflight)

    def _top_up(self) -> None:
        """Replace a lost actor where the cluster has room for it now and for a score task besides (a
        lost node's room does not come back; an actor holds its CPUs, and the score tasks need some);
        with no actor left, where it has room for one (the score stage makes room: `make_room`)."""
        import ray

        need = self.cc.rollout_cpus + (self.cc.score_cpus if self.alive() else 0)
        if self.alive() < self.cc.rollout_workers and ray.available_resources().get("CPU", 0) >= need:
            self._start()

    def make_room(self, bundles: list[dict[str, float]], what: str, free_now: bool = False) -> str | None:
        """Before a stage's work (a score task, the update's processes): where it fits on no node beside
        the warm actors (a node was lost, its room with it), stop idle actors until it fits; the next
        rollout starts them again where there is room. None when it fits; else the line that says what
        cannot be placed (it fits on no node even with every idle actor stopped). `free_now`: counted on
        what each node has available now plus this run's idle actors (placement.room_for: another run
        sharing the cluster holds the rest), exact while none of this stage's own work holds any;
        else on the nodes' totals less the idle actors (own tasks running are not told from others')."""
        import ray

        nodes = alive_nodes(ray.nodes())
        full = {n[:8]: n for n in nodes}
        actors: dict[str, int] = {}
        for actor in self.idle:
            node = full.get(self.where.get(actor, {}).get("node", ""))
            if node:
                actors[node] = actors.get(node, 0) + 1
        if free_now:
            from ray._private.state import available_resources_per_node  # Ray's per-node form of ray.available_resources()

            stop = room_for(free_nodes(ray.nodes(), available_resources_per_node()), nodes, actors, self.cc, bundles)
            if isinstance(stop, str):
                return f"{what}: {stop}" if not stop.startswith("cluster:") else stop.replace("cluster: ", f"cluster: {what}: ", 1)
        else:
            stop = actors_to_stop(nodes, actors, self.cc, bundles)
        if stop is None:
            return (f"{what}: {bundles_line(bundles)} fit on no node alive ({describe(nodes) or 'none'}), even with every "
                    f"idle rollout worker stopped")
        for node in stop:
            actor = next(a for a in self.idle if self.where.get(a, {}).get("node") == node[:8])
            self.log(f"cluster: {what}: {bundles_line(bundles)} fit on no node beside the warm rollout workers ({describe(nodes)}; "
                     f"{self.cc.rollout_cpus:g} CPUs held by each): the rollout worker on node {node[:8]} is stopped to make room")
            self.idle.remove(actor)
            self.where.pop(actor, None)
            ray.kill(actor, no_restart=True)
        return None

    def _wait_one(self):
        import ray

        waiting = list(self.inflight) + list(self.starting)
        if not waiting:
            raise GRPOError(f"cluster: no rollout worker is left (every actor died and no node alive has room for a new one: "
                            f"{describe(alive_nodes(ray.nodes())) or 'none'}, a rollout worker wants {self.cc.rollout_cpus:g} CPUs); "
                            f"add a node: {RESUME}")
        done, _ = ray.wait(waiting, num_returns=1, timeout=self.deadlines.wait_s())
        if not done:
            late = self.deadlines.overdue()
            if late is None:
                return None
            raise GRPOError(f"{late}; {describe(alive_nodes(ray.nodes()))}, {self.cc.rollout_workers} rollout workers want "
                            f"{self.cc.rollout_cpus:g} CPUs each")
        ref = done[0]
        self.deadlines.done(ref)
        if ref in self.starting:
            actor = self.starting.pop(ref)
            try:
                self.where[actor] = ray.get(ref)
                self.idle.append(actor)
                for name in self.where[actor].pop("secrets_missing", []):
                    self.log(f"cluster: {name} is set here but not on node {self.where[actor]['node']}: secrets are not sent "
                             f"through Ray (set it where `ray start` runs there)")
            except ray.exceptions.RayTaskError as err:
                raise_task_error(err, "rollout worker start")
            except ray.exceptions.RayError as err:  # died while starting: its node went away
                self.log(f"cluster: a rollout worker died while starting ({type(err).__name__})")
                self._top_up()
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
                ref = actor.rollout_part.remote(k, part, stamp)
                self.inflight[ref] = (actor, part)
                self.deadlines.start(ref, self.cc.part_timeout_s, f"rollout iteration {k} part {part}: not written in "
                                     f"{self.cc.part_timeout_s:g} s (cluster.part_timeout_s) on node {self.where.get(actor, {}).get('node', '?')}")
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
            self.deadlines.done(ref)
        return reports

    def show(self, k: int, queued: int, stage: str = "rollout", waiting: str | None = None) -> None:
        """What `grpo status` shows while the driver runs: the stage, its rollout parts in flight and the
        node of each, how many wait, and what cannot be placed (`waiting`)."""
        if self.status is not None:
            parts = {str(p): self.where.get(a, {}).get("node", "?") for a, p in self.inflight.values()}
            self.status({"stage": stage, "iteration": k, "in_flight": parts, "queued": queued, **({"waiting": waiting} if waiting else {})})

    def nodes(self) -> list[str]:
        return sorted({w["node"] for w in self.where.values()})

    def close(self, at_once: bool = False) -> None:
        """Each actor closes its engine (all together, CLOSE_S at most in all), then is killed; `at_once`
        (Ctrl-C, an error): killed now, their parts were abandoned anyway."""
        import ray

        actors = [*self.idle, *self.starting.values(), *(a for a, _ in self.inflight.values())]
        if not at_once and self.idle:
            try:
                ray.wait([a.close.remote() for a in self.idle], num_returns=len(self.idle), timeout=CLOSE_S)
            except Exception:  # closing is best effort: the actor goes with the driver anyway
                pass
        for actor in actors:
            ray.kill(actor, no_restart=True)


class Room:
    """A stage's work (`bundles`) waiting to be placed, looked at every POLL_S: the pool makes room
    again each time (Ray declares a lost node dead only after its health checks; until then its CPUs
    look free, and work sent there comes back unplaced), and work that fits on no node alive for
    cluster.place_timeout_s stops the run with one line. `show(line or None)`: what `grpo status` says."""

    def __init__(self, pool: RolloutPool, bundles: list[dict[str, float]], what: str, show: Callable[[str | None], None]):
        self.pool, self.bundles, self.what, self.show = pool, bundles, what, show
        self.since: float | None = None

    def check(self, free_now: bool = False) -> None:
        problem = self.pool.make_room(self.bundles, self.what, free_now)
        limit = self.pool.cc.place_timeout_s
        if problem is None:
            if self.since is not None:
                self.since = None
                self.show(None)
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.pool.log(f"{problem}; waiting up to {limit:g} s (cluster.place_timeout_s) for a node with room")
            self.show(problem)
        if now - self.since >= limit:
            raise GRPOError(f"{problem} for {limit:g} s (cluster.place_timeout_s); add a node with room: {RESUME}")
