"""Where a run stands, as plain data (printed by `grpo status`).

Per iteration: the stages done (rows, seconds), the headline metrics of `inspect_run.history`
(mean reward, eval accuracy of policy k, KL, ...), and the diagnostics' warnings.
"""

from __future__ import annotations

from pipeline.report.diagnostics import diagnose
from pipeline.report.inspect import history
from pipeline.store.run import Run
from pipeline.store import STAGES


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
    """While a Ray driver runs (`cluster.executor ray`): the rollout parts in flight, each with its node."""
    from pipeline.errors import GRPOError

    try:
        return run.store.read_json(".cluster/in_flight.json")
    except GRPOError:  # no Ray driver running (or between its writes)
        return None
