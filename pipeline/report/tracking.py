"""MLflow tracking: one MLflow run per grpo run, fed from the run's artifacts.

Where it logs, first match wins:
    tracking.mlflow: false          nothing at all
    tracking.mlflow_uri             that tracking server (or any MLflow URI)
    MLFLOW_TRACKING_URI             the same, from the environment
    (default)                       sqlite:///RUN/mlflow.db, artifacts in RUN/mlartifacts; embedded,
                                    nothing to start (MLflow 3 recommends a database store over the
                                    deprecated ./mlruns file store). A remote RUN (s3://) gets the
                                    same store in the local cache directory instead, and says so.

The MLflow run id is kept in RUN/tracking.json (one entry per tracking URI), so a resumed run
logs into the same MLflow run. Each stage is logged once: its metrics go in one `log_batch`
together with a ledger tag `grpo.logged.iter-0003.score` holding the manifest's sha256, and a
stage whose tag is present is never logged again. The stages and `iterate` report a stage
through `reporting` once its manifest is written (the write path never calls MLflow); that calls
`sync`, which also catches up whatever an earlier failure left out.

Off the loop's path: every hook's MLflow calls run on tracking's own thread (`_later`), one at a
time in the order the hooks were called, so a stage never waits for MLflow (its logging took
about 0.6 s of an iteration of `make demo`). `flush` waits for them: `log_final` does, and a
command's exit does (the thread's queue runs out first).

Metrics use step = iteration; the update's per-optimizer-step values are also logged as
`step/<metric>` with step = global optimizer step. Tracking never breaks a stage: any failure
is a logged warning, and the manifest is already on disk when tracking runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config.urls import redacted, scrub
from pipeline.report.tracking_names import TRACKING_JSON, Target, keyed_redacted
from pipeline.store import cache_dir, sha256_bytes
from pipeline.run.run import Run
from pipeline.update.distributed import is_rank_zero

if TYPE_CHECKING:
    from pipeline.report.mlflow_run import Tracker

log = logging.getLogger("grpo.tracking")

EMBEDDED = "embedded"


def resolve_target(run: Run) -> Target | None:
    """The MLflow store this run logs to, or None when tracking.mlflow is false."""
    t = run.cfg.tracking
    if not t.mlflow:
        return None
    uri = t.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:  # known by its redacted form: what RUN/tracking.json records (a password in MLFLOW_TRACKING_URI is not)
        return Target(uri=uri, key=redacted(uri))
    if run.store.local:
        root = Path(run.store.path()).resolve()
        return Target(f"sqlite:///{root}/mlflow.db", EMBEDDED, (root / "mlartifacts").as_uri())
    # SQLite cannot live on an object store: keep the store on this machine, next to the cache
    d = cache_dir() / "mlflow" / sha256_bytes(run.store.display().encode())[:16]
    d.mkdir(parents=True, exist_ok=True)
    note = (f"run directory {run.store.display()} is remote: MLflow logs to a local store at {d} "
            "(set tracking.mlflow_uri or MLFLOW_TRACKING_URI to share one)")
    return Target(f"sqlite:///{d}/mlflow.db", f"sqlite:///{d}/mlflow.db", (d / "mlartifacts").as_uri(), note)


def tracking_info(run: Run) -> dict | None:
    """The MLflow run this grpo run logs to ({tracking_uri, experiment_id, run_id}), read from
    RUN/tracking.json without importing MLflow; None when there is none yet."""
    target = resolve_target(run)
    if target is None or not run.store.exists(TRACKING_JSON):
        return None
    return keyed_redacted(run.store.read_json(TRACKING_JSON).get("runs", {})).get(target.key)


# -- the hooks ---------------------------------------------------------------------------------
@contextlib.contextmanager
def reporting(run: Run, k: int, stage: str):
    """Around a stage's work: once it has written its manifest (in this call, on rank 0), log it.
    The write path knows nothing of MLflow; the stages and `iterate` report through this (`iterate`'s
    own update, whose record may still be in flight, through `log_stage` once it is not)."""
    fresh = not run.done(k, stage)
    yield
    if fresh and is_rank_zero() and run.done(k, stage):
        log_stage(run, k, stage)


def log_stage(run: Run, k: int, stage: str) -> None:
    """Hook: stage `stage` of iteration k has just written its manifest. Never raises."""
    run = run.unwaited  # read on tracking's thread: a record in flight is not waited for there
    if stage == "update":
        _later(f"diagnostics of iteration {k}", lambda: _warn_new(run, k))
    _later(f"{stage} of iteration {k}", lambda: _sync(run))


def log_record_wait(run: Run, k: int, seconds: float) -> None:
    """Hook: `iterate`'s row of iteration k is final: the seconds its loop waited for the record
    (`timings["record"]`) as MLflow's `time/record_wait_s` at step k. No manifest holds them (a
    sync cannot add them later): logged by the process that waited. Never raises."""

    run = run.unwaited

    def log():
        if (tracker := _tracker(run)) is not None:
            tracker.log_metrics({"time/record_wait_s": seconds}, k)

    _later(f"the record's wait of iteration {k}", log)


def log_final(run: Run) -> None:
    """Hook: `grpo iterate` finished. Log what is missing, the newest policy, close the run."""

    run = run.unwaited

    def final():
        tracker = _tracker(run)
        if tracker is None:
            return
        tracker.sync(run, plots=False)
        if run.iterations():
            tracker.log_plots(run)
        if (k := run.completed_iters()) > 0:
            tracker.log_policy(run, k)
        tracker.client.set_terminated(tracker.run_id, "FINISHED")

    _later("the final policy", final)
    flush()


def sync(run: Run) -> list[str]:
    """Log every stage that has a manifest but is not in the MLflow run yet; returns what was
    logged (raises on failure, unlike the hooks), after what the hooks left on tracking's thread."""
    flush()
    tracker = _tracker(run)
    return tracker.sync(run) if tracker else []


def _sync(run: Run) -> None:
    if (tracker := _tracker(run)) is not None:
        tracker.sync(run, plots=False)


_LANE = ThreadPoolExecutor(1, thread_name_prefix="grpo-tracking")
"""Tracking's thread (started on the first submit): every hook's MLflow calls, one at a time, in order."""


def _later(what: str, fn) -> None:
    """`fn`, `_guard`ed, on tracking's thread after everything submitted before it."""
    _LANE.submit(_guard, what, fn)


def flush() -> None:
    """Wait for what the hooks have left on tracking's thread (never raises: `_guard` caught it)."""
    _LANE.submit(lambda: None).result()


def _guard(what: str, fn) -> None:
    try:
        fn()
    except Exception as err:  # tracking is a copy of the run directory: never let it fail a stage
        first = (scrub(str(err)).strip().splitlines() or [""])[0][:300]  # MLflow's quotes the URI, password and all
        log.warning(f"warning: MLflow: could not log {what} ({type(err).__name__}: {first}); "
                    "the run directory is complete, and the next `grpo iterate` logs what is missing")


def _warn_new(run: Run, k: int) -> None:
    """Print the diagnostics that iteration k raised (on stderr, with or without MLflow)."""
    from pipeline.report.diagnostics import diagnose
    from pipeline.report.inspect import history

    for finding in diagnose(history(run, kept=True)):  # this process's loop: earlier iterations read once
        if finding.iteration == k:
            log.warning(f"warning: {finding}")


# -- the MLflow run ------------------------------------------------------------------------------
_TRACKERS: dict[tuple[str, str], "Tracker | None"] = {}


def _tracker(run: Run) -> "Tracker | None":
    """This process's tracker for `run` (the client and run id are opened once, then kept).
    A store that could not be opened is not retried by this process: one warning, not one per stage."""
    target = resolve_target(run)
    if target is None:
        return None
    key = (run.store.display(), target.uri)
    if key not in _TRACKERS:
        _TRACKERS[key] = None
        from pipeline.report.mlflow_run import Tracker

        _TRACKERS[key] = Tracker(run, target)
    return _TRACKERS[key]
