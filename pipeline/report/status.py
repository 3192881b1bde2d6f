"""Where a run stands, as plain data (printed by `grpo status`).

Per iteration: the stages done (rows, seconds), the headline metrics of `inspect_run.history`
(mean reward, eval accuracy of policy k, KL, ...), and the diagnostics' warnings.
"""

from __future__ import annotations

from pipeline.report.diagnostics import diagnose
from pipeline.report.inspect import history
from pipeline.run.run import Run
from pipeline.store import IN_FLIGHT, STAGES


def status_report(run: Run) -> dict:
    from pipeline.report.tracking import tracking_info

    rows = history(run)
    iters = []
    for row in rows:
        k = row["iteration"]
        stages = {}
        for stage in STAGES:
            m = run.manifest(k, stage) if stage in row["done"] else None
            stages[stage] = {"rows": m.rows, "seconds": m.timings.get("seconds", 0.0)} if m else None
        iters.append({"stages": stages, **row})
    return {
        "run": run.store.display(),
        "config_hash": run.cfg_hash,
        "completed": run.completed_iters(),
        "iterations": iters,
        "warnings": [f.as_dict() for f in diagnose(rows)],
        "mlflow": tracking_info(run),
        "cluster": cluster_in_flight(run),
    }


def cluster_in_flight(run: Run) -> dict | None:
    """While a Ray driver runs (`cluster.executor ray`): the rollout parts in flight, each with its node,
    and whether the driver that wrote this is alive (`driver.alive`: True, False when its process is
    gone from this host, None when it ran on another host, where this cannot look)."""
    from pipeline.errors import GRPOError

    try:
        c = run.store.read_json(IN_FLIGHT)
    except GRPOError:  # no Ray driver running (or between its writes)
        return None
    if isinstance(c.get("driver"), dict):
        c["driver"]["alive"] = driver_alive(c["driver"])
    return c


def driver_alive(driver: dict) -> bool | None:
    """Whether the process of a driver record (pid, host, start time) still runs: None on another
    host; False when no such pid runs here, or it is another process that got the same pid."""
    import os
    import socket

    if driver.get("host") != socket.gethostname():
        return None
    pid = int(driver["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid: not our driver
        return False
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its parent
            return False
        return abs(proc.create_time() - float(driver.get("started", 0.0))) < 1.0
    except psutil.Error:
        return False
