"""The trainer state's record (pipeline.update.stored_state): a state is loaded only once its files hash
to what was recorded when it was written, in update K's manifest (a state written with the update)
or in its own MANIFEST.json (the one a command writes at its end, after update K's manifest); an
edited one is one line naming it. The real flush and resume are in test_resume.py."""

from __future__ import annotations

import json
import shutil

import pytest


def _update_done(run, k: int, state: str | None, state_every: int | None = 10) -> None:
    """Update k's manifest as the run records it (its other fields do not matter here)."""
    from schemas.manifests import FileEntry, PolicyRef, UpdateInputs, UpdateManifest, UpdateOutputs

    run.store.write_manifest(f"iter-{k:04d}/update", UpdateManifest(
        stage="update", iteration=k, schema_version=1, config_hash=run.cfg_hash, seed=0,
        inputs=UpdateInputs(rollout="r", score="s", logprobs="l", policy_hash="p"),
        outputs=UpdateOutputs(metrics=FileEntry(sha256="m", bytes=0), policy=PolicyRef(path=f"policy/iter-{k + 1:04d}", policy_hash="q"),
                              state=state),
        policy_hash="q", rows=0, optimizer_steps=0, global_step=3, kl_coef=0.0, world_size=1, state_every=state_every, timings={}))


def _state(path) -> None:
    """A state's files, as Trainer.save_state lays them out."""
    (path / "state").mkdir(parents=True)
    (path / "state/mp_rank_00_model_states.pt").write_bytes(b"\x80weights" * 64)
    (path / "trainer.json").write_text(json.dumps({"global_step": 3, "kl_controller": {"coef": 0.0}}))


def test_a_state_is_loaded_only_as_it_was_recorded(make_run, tmp_path):
    from pipeline.errors import GRPOError
    from pipeline.run.run import Run
    from pipeline.store import canonical_hash, hash_dir
    from pipeline.update.stored_state import checked, seal, state_rel

    run = Run(make_run())
    where = run.store.local_dir(state_rel(0))
    edited = lambda: (where / "trainer.json").write_text((where / "trainer.json").read_text() + " ")  # still loads as JSON

    # the state a command writes at its end: sealed in scratch, moved into the run with its MANIFEST.json
    _update_done(run, 0, state=None)
    scratch = tmp_path / "work/state"
    _state(scratch)
    seal(scratch, 0)
    shutil.move(scratch, where)
    assert checked(run, 0) == where
    edited()
    with pytest.raises(GRPOError) as err:
        checked(run, 0)
    line = str(err.value)
    assert line.startswith(f"{run.store.display(state_rel(0))}: the trainer state of iteration 0 hashes to ")
    assert "but iter-0000/update/state/MANIFEST.json records" in line and "remove it to resume from an earlier state" in line
    assert "\n" not in line

    # its MANIFEST.json moved from another iteration's state: refused, not trusted
    shutil.rmtree(where)
    _state(where)
    seal(where, 1)
    with pytest.raises(GRPOError, match=r"state/MANIFEST.json: not the record of iteration 0's trainer state$"):
        checked(run, 0)

    # a state written with update 0: its hash is in update 0's manifest
    shutil.rmtree(where)
    _state(where)
    _update_done(run, 0, state=canonical_hash(hash_dir(where)))
    assert checked(run, 0) == where
    edited()
    with pytest.raises(GRPOError, match=r"iteration 0 hashes to \w{16} but iter-0000/update/MANIFEST.json records \w{16} "):
        checked(run, 0)

    # a run written before either was recorded: loaded as before
    for state_every in (None, 10):
        _update_done(run, 0, state=None, state_every=state_every)
        assert checked(run, 0) == where
