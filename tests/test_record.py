"""The record's failures where nobody reads them at once (pipeline/update/record.py, pipeline/run/inflight.py):
a failed weights write keeps the trainer state its re-creation starts from, and a record's error met
inside a tracking call is the loop's to raise, never an MLflow warning."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest


def test_a_record_error_met_inside_a_tracking_call_is_raised_by_the_loops_wait(make_run, caplog):
    """Update 0's record fails on its thread before it names policy 1's hash. The first to meet that
    error is a tracking call (update 0's diagnostics read every update's manifest, so they settle
    the hash): it must not turn it into a warning and drop it; the loop's wait raises it, as it was."""
    from pipeline.errors import GRPOError
    from pipeline.loop.iteration import settle_record
    from pipeline.report import tracking
    from pipeline.run import inflight
    from pipeline.run.run import Run

    run = Run(make_run())
    err = GRPOError(f"{run.store.display('iter-0000/update')}: write failed: No space left on device")

    def write(p) -> None:
        raise err

    inflight.start(run.store.root, 1, write).thread.join()
    with caplog.at_level(logging.WARNING, logger="grpo.tracking"):
        tracking.log_stage(run, 0, "update")  # its diagnostics read every update's manifest: they settle the hash
        tracking.flush()  # on tracking's thread
    assert "could not log" not in caplog.text, caplog.text
    assert run.writing(1) is not None  # still the loop's to settle
    with pytest.raises(GRPOError) as got:
        settle_record(run, SimpleNamespace(unlogged=None), 1)  # the loop's wait before update 1
    assert got.value is err
    assert run.writing(1) is None and not run.done(0, "update")  # raised once there; the update is to run again


def test_an_mlflow_failure_is_still_a_warning_while_a_record_is_in_flight(make_run, caplog):
    """Only the record's own error is left to the loop: any other error of a tracking call stays a
    warning, also while a write is in flight (kept) and after one failed."""
    from pipeline.report import tracking
    from pipeline.run import inflight
    from pipeline.run.run import Run

    run = Run(make_run())

    def write(p) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    inflight.start(run.store.root, 1, write).thread.join()
    with caplog.at_level(logging.WARNING, logger="grpo.tracking"):
        tracking._guard("the test's call", lambda: (_ for _ in ()).throw(ValueError("mlflow says no")))
    assert "warning: MLflow: could not log the test's call (ValueError: mlflow says no)" in caplog.text
    with pytest.raises(Exception, match="No space left on device"):
        run.settle(None, "files")


@pytest.mark.slow
def test_a_failed_weights_write_keeps_the_state_its_re_creation_starts_from(make_run, monkeypatch):
    """train.state_every 10, keep_states 1: update 1 writes no state, `iterate` writes the state after
    it at its end. Policy 2's weights file fails to write (disk full) after update 1 is recorded, so
    policy 2 is missing: the state before update 1 (state 0) must stay, so that the next `iterate`
    re-creates policy 2 by re-running update 1 alone, not every update from policy 0."""
    from pipeline.errors import GRPOError
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run
    from pipeline.run.weights_file import DeferredWeights
    from pipeline.update import publish

    run = Run(make_run(rollout={"engine": "hf"}, train={"keep_states": 1}))

    def state(k: int) -> bool:
        return (Path(run.uri) / f"iter-{k:04d}/update/state/trainer.json").exists()

    iterate(run, 1)
    assert state(0)

    def full(self, path=None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(DeferredWeights, "write", full)
        with pytest.raises(GRPOError, match="write failed: No space left on device"):
            iterate(run, 2)
    assert run.done(1, "update") and not run.policy_done(2)
    assert state(1) and state(0)  # the state after update 1, and the one its re-run starts from

    reran, real = [], publish.rerun

    def rerun(r, i, *args):
        reran.append(i)
        return real(r, i, *args)

    monkeypatch.setattr(publish, "rerun", rerun)
    iterate(run, 2)
    assert reran == [1]  # update 1 alone, from state 0
    assert run.policy_done(2) and state(1) and not state(0)  # pruned once policy 2 is on disk


def test_the_loops_wait_for_the_record_is_an_mlflow_metric_of_its_iteration(make_run):
    """The seconds a row's `record` timing holds (no manifest holds them) go to MLflow at the
    iteration's step as `time/record_wait_s`, logged by the process that waited."""
    from mlflow import MlflowClient

    from pipeline.report import tracking
    from pipeline.run.run import Run

    run = Run(make_run(tracking={"mlflow": True}))
    tracking.log_record_wait(run, 0, 0.0)
    tracking.log_record_wait(run, 1, 2.5)
    tracking.flush()
    info = tracking.tracking_info(run)
    history = MlflowClient(tracking.resolve_target(run).uri).get_metric_history(info["run_id"], "time/record_wait_s")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 2.5)]
