"""A Ray cluster of one-CPU nodes on this machine (`ray.cluster_utils.Cluster`), started so that it
comes up on a loaded 2-core machine: what tests/test_ray.py and `make bench-ray` run the executor on.
Not used by `grpo iterate` itself (a real cluster is `ray start`, docs/scale-out.md)."""

from __future__ import annotations

import contextlib
import os
import threading

from pipeline.update.distributed import free_port

NODE = {"num_cpus": 1}  # at this machine's own address: Ray turns a loopback one into it when a driver joins


def add_worker_node(cluster) -> None:
    cluster.add_node(**NODE, runtime_env_agent_port=free_port())
    cluster.wait_for_nodes()


def lose_node(cluster, node) -> None:
    """A node gone as a machine goes: its raylet and other daemons killed (not gracefully) and every
    worker process it started with them; `Cluster.remove_node` leaves those to notice on their own,
    and one can still hand in the work it holds meanwhile (its results go to the driver directly)."""
    import psutil
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    workers = psutil.Process(raylet).children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    for proc in workers:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**NODE, "include_dashboard": False, "runtime_env_agent_port": free_port()})
    try:
        add_worker_node(cluster)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def two_nodes(attempts: int = 3):
    """Two nodes of one CPU each (the head and one worker), their processes on one thread; a start
    that fails (see ahead_of_other_jobs) is tried `attempts` times. Call .shutdown() when done."""
    with starting_nodes():
        for attempt in range(attempts):
            try:
                return _two_nodes()
            except Exception:
                if attempt == attempts - 1:
                    raise


def _announce_agent_ports(stop: threading.Event) -> None:
    """For each raylet this process starts: the agent ports it waits for, written before the agents
    are up (the metrics and agent HTTP ports as unused, as a minimal agent writes them; the runtime
    env agent's fixed port)."""
    import psutil
    from ray._raylet import (DASHBOARD_AGENT_LISTEN_PORT_NAME, METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME,
                             RUNTIME_ENV_AGENT_PORT_NAME, persist_port)

    done: set[int] = set()
    while not stop.is_set():
        for proc in psutil.Process().children(recursive=True):
            try:
                cmd = proc.cmdline() if proc.pid not in done else []
            except psutil.Error:
                continue
            if cmd and cmd[0].endswith("/raylet"):
                args = dict(a.lstrip("-").split("=", 1) for a in cmd[1:] if a.startswith("--") and "=" in a)
                for name in (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, DASHBOARD_AGENT_LISTEN_PORT_NAME):
                    persist_port(args["session_dir"], args["node_id"], name, -1)
                persist_port(args["session_dir"], args["node_id"], RUNTIME_ENV_AGENT_PORT_NAME, int(args["runtime_env_agent_port"]))
                done.add(proc.pid)
        stop.wait(0.05)


@contextlib.contextmanager
def ahead_of_other_jobs():
    """Ray 2.60's raylet gives its node's agents 15 s to write their ports and dies after that
    (hard-coded; ray-project/ray issue 65983): on a machine loaded by other jobs they miss it. So
    the agents run minimal (no metrics, which nothing here reads), their ports are written for the
    raylet before they are up, and the nodes' daemons start at a higher priority where this process
    may raise it (as root); the processes they start later run at the usual one."""
    import psutil
    import ray._private.utils

    me, stop = psutil.Process(), threading.Event()
    minimal = ray._private.utils.get_dashboard_dependency_error
    ray._private.utils.get_dashboard_dependency_error = lambda: ImportError("minimal agents (tests/test_ray.py)")
    watcher = threading.Thread(target=_announce_agent_ports, args=(stop,), daemon=True)
    watcher.start()
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, -20)
    try:
        yield
    finally:
        stop.set()
        ray._private.utils.get_dashboard_dependency_error = minimal
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error, PermissionError):
                    os.setpriority(os.PRIO_PROCESS, child.pid, 0)


@contextlib.contextmanager
def starting_nodes():
    """While nodes start: their processes inherit one thread each, and start ahead of other jobs."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with ahead_of_other_jobs():
            yield
    finally:
        os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.__setitem__("OMP_NUM_THREADS", saved)
