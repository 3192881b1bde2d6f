"""Where the work can go, node by node: a cluster's totals can hold every worker while no single
node has room for a score task beside the warm rollout actors (each actor keeps its node's CPUs
from the first iteration to the last). Pure functions over what `ray.nodes()` reports, so the
decisions are tested without a cluster; pipeline/cluster/executor.py and pool.py act on them."""

from __future__ import annotations

import time

UNITS = ("CPU", "GPU")


def alive_nodes(ray_nodes: list[dict]) -> dict[str, dict[str, float]]:
    """{node id: {CPU, GPU}} of the nodes alive (what `ray.nodes()` lists, totals)."""
    return {n["NodeID"]: {u: float(n.get("Resources", {}).get(u, 0.0)) for u in UNITS} for n in ray_nodes if n.get("Alive")}


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(u, 0.0) + 1e-9 >= need.get(u, 0.0) for u in UNITS)


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for u in UNITS:
        free[u] = free.get(u, 0.0) - need.get(u, 0.0)


def describe(nodes: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"node {n[:8]} {r['CPU']:g} CPU" + (f" {r['GPU']:g} GPU" if r.get("GPU") else "") for n, r in sorted(nodes.items()))


def spread_problem(nodes: dict[str, dict[str, float]], cc) -> str | None:
    """None when the rollout actors, spread over the nodes as Ray's SPREAD places them (the next on
    the node holding fewest of them where it fits), leave one node with room for a score task;
    else the line that says what cannot be placed."""
    actor = {"CPU": cc.rollout_cpus, "GPU": cc.rollout_gpus}
    task = {"CPU": cc.score_cpus, "GPU": 0.0}
    free = {n: dict(r) for n, r in nodes.items()}
    count = dict.fromkeys(free, 0)
    for i in range(cc.rollout_workers):
        fitting = [n for n in sorted(free) if _fits(free[n], actor)]
        if not fitting:
            return (f"cluster: rollout worker {i + 1} of {cc.rollout_workers} ({cc.rollout_cpus:g} CPUs, {cc.rollout_gpus:g} GPUs: "
                    f"cluster.rollout_cpus, rollout_gpus) fits on no node once the others are placed ({describe(nodes)})")
        n = min(fitting, key=lambda n: count[n])
        _take(free[n], actor)
        count[n] += 1
    if not any(_fits(r, task) for r in free.values()):
        left = ", ".join(f"node {n[:8]} {r['CPU']:g}" for n, r in sorted(free.items()))
        return (f"cluster: with the {cc.rollout_workers} warm rollout workers placed ({cc.rollout_cpus:g} CPUs each), no node "
                f"has the {cc.score_cpus:g} CPUs of a score task (cluster.score_cpus) left (CPUs left: {left}); lower "
                f"cluster.rollout_cpus or score_cpus, or add a node")
    return None


def node_to_free(nodes: dict[str, dict[str, float]], actors: dict[str, int], cc) -> str | None:
    """Before the score tasks: None when a node has room for one beside the warm actors (`actors`:
    node id -> how many it holds), else the node whose idle actor to stop so that one fits (the one
    with most room once freed). A lost node leaves the survivors' CPUs held by their actors: without
    this, no score task can ever be placed and the stage waits for ever."""
    task = {"CPU": cc.score_cpus, "GPU": 0.0}
    free = {}
    for n, r in nodes.items():
        left = dict(r)
        for _ in range(actors.get(n, 0)):
            _take(left, {"CPU": cc.rollout_cpus, "GPU": cc.rollout_gpus})
        free[n] = left
    if any(_fits(r, task) for r in free.values()):
        return None
    held = [n for n in free if actors.get(n)]
    freed = {n: {**free[n], "CPU": free[n]["CPU"] + cc.rollout_cpus} for n in held}
    fitting = [n for n in sorted(freed) if _fits(freed[n], task)]
    return max(fitting, key=lambda n: freed[n]["CPU"]) if fitting else None


class Deadlines:
    """Each thing waited for (an actor starting, a part) with its own limit; `wait_s` is how long
    ray.wait may block before the first of them is due, `overdue` the first one past its limit."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.due = clock, {}

    def start(self, key, limit_s: float, what: str) -> None:
        self.due[key] = (self.clock() + limit_s, what)

    def done(self, key) -> None:
        self.due.pop(key, None)

    def wait_s(self) -> float | None:
        if not self.due:
            return None
        return max(0.0, min(t for t, _ in self.due.values()) - self.clock())

    def overdue(self) -> str | None:
        now = self.clock()
        late = [what for t, what in sorted(self.due.values(), key=lambda x: x[0]) if t <= now]
        return late[0] if late else None


def reserve_driver_gpu(node_gpus: float, cc) -> bool:
    """Whether the driver takes one GPU of its own node from Ray before any actor is placed: on a GPU
    cluster (its workers ask for GPUs) whose driver's node has Ray GPUs, Ray would otherwise hand the
    driver's GPU (it runs logprobs and the update) to the first actor placed there."""
    workers_use_gpus = cc.rollout_gpus > 0 or (cc.update_workers > 1 and cc.update_gpus > 0)
    return workers_use_gpus and node_gpus >= 1
