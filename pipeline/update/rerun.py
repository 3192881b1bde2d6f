"""Re-running an update from its stored parts, for a resume between two trainer states
(`train.state_every`) and for a policy whose background write a kill stopped (publish.py's
resume_trainer and restore_policy): the re-run must reproduce the policy hash update i recorded."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.run.run import Run, policy_manifest
from pipeline.update.data import UpdateData
from pipeline.update.trainer import STATE, Trainer


def rerunnable(run: Run, i: int, trainer: Trainer) -> None:
    """A re-run reproduces update i's bytes only with the process count and arithmetic it was
    recorded with (2 processes sum gradients in another order); every rank reads the same record
    and stops alike, before any work."""
    m = run.manifest(i, "update")
    if (m.world_size, m.precision or trainer.precision) != (trainer.world, trainer.precision):
        raise GRPOError(f"update iteration {i}: its trainer state was not kept (train.state_every {run.cfg.train.state_every}) and resuming "
                        f"re-runs it, but it was recorded by {m.world_size} process(es) in {m.precision} and this update has "
                        f"{trainer.world} in {trainer.precision}; resume with {m.world_size} process(es) on a machine computing in {m.precision}")


def rerun(run: Run, i: int, k: int, trainer: Trainer, work: Path) -> dict[str, str]:
    """Update i again from its stored parts, on a trainer holding the state before it, its policy
    saved into `work`/policy; it must hash to what update i recorded. Returns {file: sha256}."""
    data = UpdateData(run, i, trainer.kl_ctl)
    trainer.train_iteration(data, i)
    if data.kl_stats is not None:
        trainer.kl_ctl.update(data.kl_stats, data.size)
    # the side files (tokenizer, template) are every policy's: taken from policy k, never pruned
    hashed = trainer.save_policy(work / "policy", run.policy_dir(k), work / STATE)
    trainer.published = None
    if trainer.rank == 0:
        got = policy_manifest(work / "policy", i + 1, source="re-run", hashed=hashed).policy_hash
        recorded = run.manifest(i, "update").policy_hash
        if got != recorded:
            raise GRPOError(f"update iteration {i}: re-run from its stored parts to resume, it gave policy hash {got[:16]} "
                            f"but the run records {recorded[:16]} (the record or its parts changed); nothing was written")
    return hashed
