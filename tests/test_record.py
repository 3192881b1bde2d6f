"""The record's failures where nobody reads them at once (pipeline/update/record.py, pipeline/run/inflight.py):
a failed weights write keeps the trainer state its re-creation starts from, and a record's error met
inside a tracking call is the loop's to raise, never an MLflow warning."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest


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
