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


def keyed_redacted(runs: dict) -> dict:
    """tracking.json's `runs` keyed by the redacted tracking URI (pipeline/config/urls.py: redacted), as
    `Target.key` is: a ledger written before keys were redacted (one held MLFLOW_TRACKING_URI's password)
    reads to the entry a resume looks up, and its rewrite keeps no password."""
    from pipeline.config.urls import redacted

    return {redacted(k): {**v, "tracking_uri": redacted(v["tracking_uri"])} if isinstance(v, dict) and isinstance(
        v.get("tracking_uri"), str) else v for k, v in runs.items()}
