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


def free_nodes(ray_nodes: list[dict], available: dict[str, dict]) -> dict[str, dict[str, float]]:
    """{node id: {CPU, GPU}} free now on the nodes alive: `available` is Ray's per-node view of what
    no actor, task or placement group holds (`ray._private.state.available_resources_per_node()`,
    the per-node form of `ray.available_resources()`; a unit all in use is absent there: 0)."""
    return {n: {u: float(available.get(n, {}).get(u, 0.0)) for u in UNITS} for n in alive_nodes(ray_nodes)}


def held_elsewhere(free: dict[str, dict[str, float]], nodes: dict[str, dict[str, float]], cc) -> str | None:
    """None when this run's warm rollout actors and a score task fit in what is `free` now (spread as
    `spread_problem` places them); else the line saying what the run waits for: the nodes' totals hold
    it (spread_problem passed on them), so other work holds the rest: another run sharing the cluster."""
    if spread_problem(free, cc) is None:
        return None
    return (f"cluster: waiting for room: other work on the cluster (another run?) holds what this run's {cc.rollout_workers} "
            f"rollout workers ({cc.rollout_cpus:g} CPUs each) and a score task ({cc.score_cpus:g} CPUs) need; free now: "
            f"{describe(free) or 'nothing'} (of {describe(nodes)})")


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
    i = _spread(free, actor, cc.rollout_workers)
    if i is not None:
        return (f"cluster: rollout worker {i + 1} of {cc.rollout_workers} ({cc.rollout_cpus:g} CPUs, {cc.rollout_gpus:g} GPUs: "
                f"cluster.rollout_cpus, rollout_gpus) fits on no node once the others are placed ({describe(nodes)})")
    # Ray's SPREAD may place the actors otherwise than this one spread (its choice among nodes holding as
    # many is not by id): one spread that keeps some node's room for a score task is enough
    if not any(_fits(r, task) for r in free.values()) and not any(_spread(_keeping(nodes, n, task), actor, cc.rollout_workers) is None
                                                                for n in sorted(nodes) if _fits(nodes[n], task)):
        left = ", ".join(f"node {n[:8]} {r['CPU']:g}" for n, r in sorted(free.items()))
        return (f"cluster: with the {cc.rollout_workers} warm rollout workers placed ({cc.rollout_cpus:g} CPUs each), no node "
                f"has the {cc.score_cpus:g} CPUs of a score task (cluster.score_cpus) left (CPUs left: {left}); lower "
                f"cluster.rollout_cpus or score_cpus, or add a node")
    return None


def _keeping(nodes: dict[str, dict[str, float]], n: str, need: dict[str, float]) -> dict[str, dict[str, float]]:
    """A copy of `nodes` with `need` taken from node n."""
    free = {m: dict(r) for m, r in nodes.items()}
    _take(free[n], need)
    return free


def _spread(free: dict[str, dict[str, float]], actor: dict[str, float], workers: int) -> int | None:
    """Place `workers` actors as SPREAD does (the next on a node holding fewest where it fits), taking
    their room from `free`; None when all fit, else the index of the first that fits nowhere."""
    count = dict.fromkeys(free, 0)
    for i in range(workers):
        fitting = [n for n in sorted(free) if _fits(free[n], actor)]
        if not fitting:
            return i
        n = min(fitting, key=lambda n: count[n])
        _take(free[n], actor)
        count[n] += 1
    return None


def _placeable(free: dict[str, dict[str, float]], bundles: list[dict[str, float]]) -> bool:
    """Whether every bundle fits somewhere (largest first, each on the first node with room)."""
    free = {n: dict(r) for n, r in free.items()}
    for b in sorted(bundles, key=lambda b: (-b.get("GPU", 0.0), -b.get("CPU", 0.0))):
        n = next((n for n in sorted(free) if _fits(free[n], b)), None)
        if n is None:
            return False
        _take(free[n], b)
    return True


def actors_to_stop(nodes: dict[str, dict[str, float]], actors: dict[str, int], cc,
                   bundles: list[dict[str, float]]) -> list[str] | None:
    """Room for a stage's work (`bundles`: a score task, or the update's processes) beside the warm
    rollout actors (`actors`: node id -> idle actors it holds). [] when it fits now; else the nodes
    whose idle actors to stop (one entry per actor, the node with most room once freed first) until it
    fits; None when it fits nowhere even with every idle actor stopped. A lost node leaves the
    survivors' CPUs held by their actors: without this, such work is never placed and the stage
    waits for ever."""
    each = {"CPU": cc.rollout_cpus, "GPU": cc.rollout_gpus}
    free, held = {}, {}
    for n, r in nodes.items():
        free[n] = dict(r)
        held[n] = actors.get(n, 0)
        for _ in range(held[n]):
            _take(free[n], each)
    stop: list[str] = []
    while not _placeable(free, bundles):
        candidates = [n for n in sorted(held) if held[n]]
        if not candidates:
            return None
        n = max(candidates, key=lambda n: free[n]["CPU"] + each["CPU"])
        held[n] -= 1
        free[n] = {u: free[n][u] + each[u] for u in UNITS}
        stop.append(n)
    return stop


def room_for(free: dict[str, dict[str, float]], nodes: dict[str, dict[str, float]], actors: dict[str, int], cc,
             bundles: list[dict[str, float]]) -> list[str] | str:
    """Room for a stage's work counted on what is `free` now on each node (Ray's per-node available
    view: another run's actors and tasks hold the rest) plus what this run's own idle actors hold
    there: the idle actors to stop (actors_to_stop's list, [] when it fits now), or the line saying
    what it waits for, naming whether the nodes' totals hold it (then other work holds the room)."""
    each = {"CPU": cc.rollout_cpus, "GPU": cc.rollout_gpus}
    mine = {n: {u: free.get(n, {}).get(u, 0.0) + actors.get(n, 0) * each[u] for u in UNITS} for n in nodes}
    stop = actors_to_stop(mine, actors, cc, bundles)
    if stop is not None:
        return stop
    if actors_to_stop(nodes, actors, cc, bundles) is not None:  # the nodes' totals hold it: what holds the room is outside this run
        return (f"cluster: waiting for room: other work on the cluster (another run?) holds what {bundles_line(bundles)} need "
                f"beside this run's idle rollout workers; free now: {describe(free) or 'nothing'} (of {describe(nodes)})")
    return f"{bundles_line(bundles)} fit on no node alive ({describe(nodes) or 'none'}), even with every idle rollout worker stopped"


def bundles_line(bundles: list[dict[str, float]]) -> str:
    """`2 x 0.5 CPU`, `1 x 1 CPU 1 GPU`: what a stage's work asks for."""
    b = bundles[0]
    return f"{len(bundles)} x {b.get('CPU', 0.0):g} CPU" + (f" {b['GPU']:g} GPU" if b.get("GPU") else "")


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
