"""Where a run stands, as plain data (printed by `grpo status`, logged by tracking)."""

from __future__ import annotations

from pipeline.iterate import iteration_summary
from pipeline.run import Run
from pipeline.store import STAGES


def status_report(run: Run) -> dict:
    iters = []
    last = max(run.iterations() + [run.completed_iters()])
    for k in range(last + 1):
        stages = {}
        for stage in STAGES:
            m = run.manifest(k, stage)
            stages[stage] = {"rows": m.get("rows", 0), "seconds": m.get("timings", {}).get("seconds", 0.0)} if m else None
        row = {"iteration": k, "stages": stages, **iteration_summary(run, k)}
        from pipeline.evaluate import eval_summary

        row.update(eval_summary(run, k) or {})  # eval of policy k (the one iteration k starts from)
        iters.append(row)
    return {
        "run": run.store.display(),
        "config_hash": run.cfg_hash,
        "completed": run.completed_iters(),
        "iterations": iters,
        "warnings": [],
    }
