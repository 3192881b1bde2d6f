"""What the tracking hooks (`pipeline.report.tracking`: when to log) and the MLflow logger
(`pipeline.report.mlflow_run`: what is logged) both use, on a floor below the two: the files they
keep in the run directory, the MLflow tag and limit they write by, the plots, and `Target`, the
store a run logs to. Nothing here imports MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACKING_JSON = "tracking.json"
LOCK = ".lock-tracking"
LEDGER = "grpo.logged."
MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch

PLOTS = (
    ("reward.png", "reward/mean", "mean reward (total and per function)"),
    ("eval_accuracy.png", "eval/accuracy", "held-out accuracy of policy k"),
    ("kl.png", "kl/mean", "KL(policy || ref) per token"),
    ("completion_length.png", "completions/mean_length", "mean completion length (tokens)"),
)


@dataclass(frozen=True)
class Target:
    """Where a run logs: the tracking URI, its key in tracking.json, the experiment's artifact root."""

    uri: str
    key: str
    artifact_location: str | None = None
    note: str | None = None
