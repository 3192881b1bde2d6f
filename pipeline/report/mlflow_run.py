"""The MLflow side of tracking: one MLflow run per grpo run, found or created once, and what is
logged into it (stage metrics with a ledger tag, manifests, completion tables, plots, the policy).
`pipeline.report.tracking` decides when; this module does the logging. MLflow is imported inside.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path

from pipeline.config.urls import redacted
from pipeline.report.tracking_names import LEDGER, LOCK, MAX_BATCH, PLOTS, TRACKING_JSON, Target, keyed_redacted
from pipeline.store import MANIFEST, code_version, iter_name, policy_rel, sha256_bytes, stage_rel
from pipeline.run.run import Run
from schemas.artifacts import STEP_METRICS
from schemas.manifests import parse_manifest

log = logging.getLogger("grpo.tracking")  # the logger of pipeline.report.tracking: one name for all its warnings


def flat_params(tree, prefix: str = "") -> dict[str, str]:
    """The resolved config as MLflow params: dotted keys (`rollout.num_generations`), lists of
    sections indexed (`rewards.0.fn`), other lists and empty sections as JSON."""
    out: dict[str, str] = {}
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            out.update(flat_params(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        for i, value in enumerate(tree):
            out.update(flat_params(value, f"{prefix}.{i}"))
    else:
        text = json.dumps(tree) if isinstance(tree, (list, dict)) else str(tree)
        out[_key(prefix)] = text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's value limit
    return out


def _key(name: str) -> str:
    """MLflow keys allow alphanumerics, `_ - . /` and spaces."""
    return re.sub(r"[^\w\-./ ]", "_", name)[:250]


def _ms(created: str | None) -> int:
    if not created:
        return int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    return int(dt.datetime.fromisoformat(created).timestamp() * 1000)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _quiet_mlflow() -> None:
    """The store's schema migrations log INFO lines on first use; they are not the user's news."""
    for name in ("mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


class Tracker:
    """A grpo run's MLflow run: found (tracking.json, then the run's tags) or created once."""

    def __init__(self, run: Run, target: Target):
        from mlflow.tracking import MlflowClient

        _quiet_mlflow()
        # MLflow's default (7 retries, backoff up to 2 min) would stall a stage for minutes on a
        # server that is down; the run directory is the record, so give up sooner
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        if target.note:
            log.warning(f"note: {target.note}")
        self.target = target
        self.client = MlflowClient(target.uri)
        self.experiment_id = self._experiment(run.cfg.tracking.experiment)
        with run.store.lock(LOCK, "MLflow run", wait=300):
            self.run_id = self._find_or_create(run)
        self.client.set_tag(self.run_id, "grpo.code_version", code_version())

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, artifact_location=self.target.artifact_location)
            except MlflowException:  # another process created it first
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def _find_or_create(self, run: Run) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        ledger = run.store.read_json(TRACKING_JSON) if run.store.exists(TRACKING_JSON) else {"runs": {}}
        runs = ledger.setdefault("runs", {})
        if (clean := keyed_redacted(runs)) != runs:  # written before the ledger kept URIs redacted: its password goes
            ledger["runs"] = clean
            run.store.write_json(TRACKING_JSON, ledger)
        known = ledger["runs"].get(self.target.key)
        run_id = None
        if known:
            try:
                if self.client.get_run(known["run_id"]).info.lifecycle_stage == "active":
                    run_id = known["run_id"]
            except MlflowException:  # deleted from the store, or a different server now
                run_id = None
        display = run.store.display()
        if run_id is None and "'" not in display:  # tracking.json lost after the run was created
            found = self.client.search_runs(
                [self.experiment_id],
                f"tags.`grpo.run_uri` = '{display}' and tags.`grpo.config_hash` = '{run.cfg_hash}'",
                max_results=1,
            )
            run_id = found[0].info.run_id if found else None
        if run_id is None:
            tags = {"grpo.run_uri": display, "grpo.config_hash": run.cfg_hash, "grpo.code_version": code_version()}
            created = self.client.create_run(self.experiment_id, tags=tags, run_name=Path(run.store.path()).name)
            run_id = created.info.run_id
            params = [Param(k, v) for k, v in flat_params(run.cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            self.client.log_batch(run_id, tags=[RunTag("grpo.params_logged", "1")])
        if not known or known.get("run_id") != run_id:
            ledger["runs"][self.target.key] = {"tracking_uri": redacted(self.target.uri), "experiment_id": self.experiment_id, "run_id": run_id}
            run.store.write_json(TRACKING_JSON, ledger)
        return run_id

    # -- logging ----------------------------------------------------------------------------
    def sync(self, run: Run, plots: bool = True) -> list[str]:
        """Log each stage with a manifest and no ledger tag, in iteration order; then refresh the
        plots if an update or eval was logged and `plots` (else only every tracking.plots_every
        iterations). On `Run.unwaited` (the hooks'), an update whose record is in flight is not done:
        a later sync logs it with its policy's manifest."""
        from pipeline.report.inspect import TRACKED_STAGES

        with run.store.lock(LOCK, "MLflow logging", wait=300):
            tags = self.client.get_run(self.run_id).data.tags
            done = []
            last = max(run.iterations() + [run.completed_iters()])
            for k in range(last + 1):
                for stage in TRACKED_STAGES:
                    tag = f"{LEDGER}{iter_name(k)}.{stage}"
                    if tag not in tags and run.done(k, stage):
                        self.log_stage(run, k, stage, tag)
                        done.append((k, stage))
            every = run.cfg.tracking.plots_every
            due = plots or (every > 0 and any(stage == "update" and (k + 1) % every == 0 for k, stage in done))
            if due and any(stage in ("update", "eval") for _, stage in done):
                self.log_plots(run)
        return [stage_rel(k, stage) for k, stage in done]

    def log_stage(self, run: Run, k: int, stage: str, tag: str) -> None:
        """Artifacts first (re-logging overwrites them), then metrics + ledger tag in one batch."""
        from mlflow.entities import Metric, RunTag

        from pipeline.report.inspect import completion_sample, stage_metrics, update_steps

        store, sd = run.store, stage_rel(k, stage)
        raw = store.read_bytes(f"{sd}/{MANIFEST}")
        manifest = parse_manifest(raw, store.display(f"{sd}/{MANIFEST}"))  # the bytes the ledger tag hashes, read once
        self._log_bytes(raw, MANIFEST, f"manifests/{sd}")
        if stage == "update" and run.policy_done(k + 1):
            self._log_bytes(store.read_bytes(f"{policy_rel(k + 1)}/{MANIFEST}"), MANIFEST, f"manifests/{policy_rel(k + 1)}")
        if stage == "score" and (n := run.cfg.tracking.sample_completions) > 0:
            self._log_sample(completion_sample(run, k, n), k)

        ts = _ms(manifest.created)
        metrics = [Metric(_key(name), float(v), ts, k) for name, v in stage_metrics(run, k, stage).items() if _finite(v)]
        if stage == "update":
            for row in update_steps(run, k).iter_rows(named=True):
                for name in (*STEP_METRICS, "grad_norm", "lr"):
                    if _finite(row[name]):
                        metrics.append(Metric(f"step/{name}", float(row[name]), ts, int(row["step"])))
        ledger = RunTag(tag, sha256_bytes(raw))
        chunks = [metrics[i : i + MAX_BATCH] for i in range(0, len(metrics), MAX_BATCH)] or [[]]
        for i, chunk in enumerate(chunks):
            self.client.log_batch(self.run_id, metrics=chunk, tags=[ledger] if i == len(chunks) - 1 else [])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metrics no manifest holds (what only the process that ran the iteration measured), at `step`."""
        from mlflow.entities import Metric

        batch = [Metric(_key(name), float(v), _ms(None), step) for name, v in metrics.items() if _finite(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def _log_bytes(self, data: bytes, name: str, artifact_path: str) -> None:
        with tempfile.TemporaryDirectory(prefix="grpo-mlflow-") as tmp:
            path = Path(tmp) / name
            path.write_bytes(data)
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def _log_sample(self, sample, k: int) -> None:
        """The MLflow table of iteration k's sampled completions. log_table appends to an existing
        file, so a retry after a crash between this and the ledger tag must not log it twice."""
        name = f"completions/{iter_name(k)}.json"
        if any(f.path == name for f in self.client.list_artifacts(self.run_id, "completions")):
            return
        self.client.log_table(self.run_id, data=sample.to_dict(as_series=False), artifact_file=name)

    def log_plots(self, run: Run) -> None:
        """Reward, eval accuracy, KL and completion length over iterations as PNGs, plus the
        diagnostics so far; overwritten at every refresh."""
        from pipeline.report.diagnostics import diagnose
        from pipeline.report.inspect import history

        rows = history(run)
        with tempfile.TemporaryDirectory(prefix="grpo-plots-") as tmp:
            write_plots(rows, [r.column for r in run.cfg.rewards], Path(tmp))
            self.client.log_artifacts(self.run_id, tmp, "plots")
        findings = [f.as_dict() for f in diagnose(rows)]
        self._log_bytes((json.dumps(findings, indent=2) + "\n").encode(), "diagnostics.json", "")

    def log_policy(self, run: Run, k: int) -> None:
        """Policy k's model directory as artifacts under policy/iter-000k (once)."""
        from mlflow.entities import RunTag

        tag = f"{LEDGER}policy.{iter_name(k)}"
        if tag in self.client.get_run(self.run_id).data.tags:
            return
        self.client.log_artifacts(self.run_id, str(run.policy_dir(k)), policy_rel(k))
        self.client.log_batch(self.run_id, tags=[RunTag("grpo.final_policy", policy_rel(k)), RunTag(tag, run.policy_hash(k))])


def write_plots(rows: list[dict], reward_names: list[str], out: Path) -> list[Path]:
    """One PNG per headline metric over iterations (matplotlib's object API: no global backend)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    paths = []
    for fname, key, title in PLOTS:
        fig = Figure(figsize=(5.5, 3.4), dpi=100)
        ax = fig.add_subplot()
        series = [(key, key)]
        if key == "reward/mean":
            series += [(f"rewards/{n}/mean", n) for n in reward_names]
        plotted = False
        for metric, label in series:
            pts = [(r["iteration"], r[metric]) for r in rows if _finite(r.get(metric))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=label, linewidth=2 if metric == key else 1)
                plotted = True
        if not plotted:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        elif len(series) > 1:
            ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="iteration", ylabel=key, title=title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / fname)
        paths.append(out / fname)
    return paths


__all__ = ["Tracker", "flat_params", "write_plots"]
