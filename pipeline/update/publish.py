"""Stage 4: train policy k into policy k+1 with DeepSpeed on iteration k's stored completions.

    iter-k/{rollout,score,logprobs} --policy/iter-k, iter-(k-1)/update/state-->
        policy/iter-(k+1) + iter-k/update/{metrics.parquet, state/, MANIFEST.json}

`train.epochs` passes over the shuffled completions, `train.mini_batch_size` completions per
optimizer step split into `train.grad_accum` micro-batches; the loss is `pipeline.objective.loss.policy_loss`.
The optimizer, scheduler, step count and KL controller carry over from iteration to iteration
(as in one long TRL run) through `iter-k/update/state`. The update is deterministic on a given
machine, so an update killed midway is simply redone from its start and gives the same weights.

Single process here; under `deepspeed` / `torchrun` each rank takes its slice of every
mini-batch (data parallel, same global batch).

What update k leaves in the run, and in what order (inline, or on a thread while `iterate`'s
next rollout runs), is pipeline/update/record.py; here: training it, re-creating a policy a kill
left missing (`restore_policy`), and the warm trainer's state at the end (`flush_state`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pipeline.errors import GRPOError
from pipeline.run.sampler_proof import check_sampler_gap
from pipeline.store import cache_dir, canonical_hash, hash_dir, policy_rel, stage_rel
from pipeline.store.faults import fault_point
from pipeline.run.retention import prune_policies
from pipeline.run.run import Run
from pipeline.update import record
from pipeline.update.record import has_state as _has_state, policy_manifest_of as _policy_manifest, prune_states as _prune_states
from pipeline.update.data import UpdateData
from pipeline.update.rerun import rerun, rerunnable
from pipeline.update.stored_state import checked, seal, state_rel
from pipeline.update.distributed import barrier as _barrier, init_distributed, is_rank_zero
from pipeline.update.trainer import STATE, Trainer
from schemas.manifests import UpdateManifest


def _agreed_done(run: Run, k: int) -> bool:
    """Whether update k is done, as rank 0 (the lock holder) sees it. Ranks deciding on their
    own could split: one returning, the others training and waiting forever in a collective."""
    done = run.done(k, "update")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from pipeline.models.engines import cpu_env

        cpu_env()
        init_distributed()
        flag = [done]
        torch.distributed.broadcast_object_list(flag, src=0)
        done = bool(flag[0])
    return done


def _work_dir(run: Run, k: int) -> Path:
    """Scratch space every rank of this machine agrees on (checkpoint shards meet here)."""
    if run.store.local:
        return Path(run.store.path(stage_rel(k, "update"))) / ".work"
    return cache_dir() / "update" / canonical_hash([run.store.display(), k])[:24]


def run_update(run: Run, k: int, trainer: Trainer | None = None, final: bool = True,
               readers_here: bool = False) -> tuple[UpdateManifest | None, Trainer | None]:
    """Train policy k -> k+1. Returns the manifest and the (warm) trainer. `final`: the command's
    last update, whose trainer state is always written (`iterate` passes False and writes the
    state at its end, `flush_state`). `readers_here`: every reader of policy k+1 is in this process
    (`iterate`'s sampler), so its record may be written on a thread after this returns
    (`record.save_policy` decides)."""
    record.check_none_in_flight(run, f"update iteration {k}")  # the loop's own wait, timed, came first
    if run.done(k, "update"):
        if not run.policy_done(k + 1):  # a kill stopped its background write
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise GRPOError(f"update iteration {k}: policy {k + 1}'s write was interrupted; re-create it in one "
                                f"process (`grpo update {run.uri} --iter {k}` or `grpo iterate`) first")
            return run.manifest(k, "update"), restore_policy(run, k, trainer)
        return run.manifest(k, "update"), trainer
    store, cfg = run.store, run.cfg
    for needs in ("rollout", "score", "logprobs"):
        run.require(k, "update", needs)
    if k > 0 and not run.done(k - 1, "update"):
        raise GRPOError(f"update iteration {k}: update of iteration {k - 1} is not done")
    sd = stage_rel(k, "update")
    t0 = time.time()
    lock = store.lock(f"{sd}/.lock", f"update iteration {k}") if is_rank_zero() else contextlib.nullcontext()
    with lock:
        if is_rank_zero():
            record.wait_for_other_writer(run, k)  # another process records update k on its thread
        if _agreed_done(run, k):  # another process finished it while this one waited to start
            return run.manifest(k, "update"), trainer
        if trainer is None:
            trainer = resume_trainer(run, k)
        trainer.clean_after = None  # mid-update: its state is no iteration's until published
        data = UpdateData(run, k, trainer.kl_ctl)
        rows = trainer.train_iteration(data, k)
        if data.old_from_update:  # the sampler gap is measured here, from the update's own forward (every rank holds it)
            check_sampler_gap(cfg, k, data.old_table().column("sampler_gap_mean").to_pylist(), f"update iteration {k}", run)
        if data.kl_stats is not None:
            trainer.kl_ctl.update(data.kl_stats, data.size)
        train_s = time.time() - t0
        fault_point("update:train", k)

        work = _fresh_work(run, k, trainer)
        state_dir = work / STATE
        with_state = final or state_due(cfg, k, trainer)
        if with_state:
            trainer.save_state(state_dir)
            _barrier()  # every rank's shard of the state is written
        with ThreadPoolExecutor(1) as pool:
            # the state's sha256 (1 s for 1.6 GB) runs on the other core while the policy is saved and hashed
            state_hash = pool.submit(lambda: canonical_hash(hash_dir(state_dir))) if trainer.rank == 0 and with_state else None
            saved = record.save_policy(run, k, trainer, work, readers_here)  # what record.publish is handed
            _barrier()
            manifest = None
            if trainer.rank == 0:
                manifest = record.publish(run, k, trainer, data, rows, work, t0, train_s, state_hash, saved)
                if trainer.published is not None:  # the weights it saved are now policy k+1 (rollout.weight_sync memory)
                    trainer.published = (run.policy_dir(k + 1, weights=False), *trainer.published[1:])
            _barrier()
        trainer.clean_after = k
    return manifest, trainer


def state_due(cfg, k: int, trainer: Trainer) -> bool:
    """Whether update k writes the trainer state: every `train.state_every`-th, and every one where
    the policy is consolidated from it (ZeRO-3, several ranks: pipeline.update.weights)."""
    return (k + 1) % cfg.train.state_every == 0 or trainer.world > 1 or cfg.train.zero_stage >= 3


def _fresh_work(run: Run, k: int, trainer: Trainer) -> Path:
    work = _work_dir(run, k)
    if trainer.rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    _barrier()
    return work


def resume_trainer(run: Run, k: int) -> Trainer:
    """A trainer ready for update k: from the state update k-1 wrote, or, where the run was killed
    between two states (`train.state_every`), from the newest earlier state (or policy 0 with a
    fresh optimizer) with the missing updates re-run from their stored parts, each checked against
    the policy hash it recorded. A state is checked first against the hash recorded with it
    (stored_state.checked)."""
    cfg, base = run.cfg, run.policy_dir(0)
    newest = next((i for i in range(k - 1, -1, -1) if _has_state(run, i)), None)
    if k == 0 or newest == k - 1:
        return Trainer(cfg, run.policy_dir(k), checked(run, k - 1) if k > 0 else None, base_dir=base)
    if newest is None:  # no state yet: the first update's trainer, policy 0 and a fresh optimizer
        trainer = Trainer(cfg, base, None, base_dir=base)
    else:  # policy k (kept by retention) gives the shapes; the state then sets every weight
        trainer = Trainer(cfg, run.policy_dir(k), checked(run, newest), base_dir=base)
    for i in range(0 if newest is None else newest + 1, k):
        rerunnable(run, i, trainer)
    for i in range(0 if newest is None else newest + 1, k):
        work = _fresh_work(run, i, trainer)
        try:
            rerun(run, i, k, trainer, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    trainer.clean_after = k - 1
    return trainer


def restore_policy(run: Run, k: int, trainer: Trainer | None = None) -> Trainer:
    """Policy k+1 where update k is done and a kill stopped the background write of its file:
    update k re-run from its stored parts (on the trainer before it, `resume_trainer`), its
    policy checked against the hash update k recorded (one line naming the iteration if not) and
    written as the uninterrupted update wrote it. Returns the trainer, holding the state after update k."""
    with record.recreating(run, k):  # not while another process still writes it
        if run.policy_done(k + 1):  # that write finished meanwhile
            return trainer
        if trainer is None or trainer.clean_after != k - 1:
            if trainer is not None:
                trainer.close()
            trainer = resume_trainer(run, k)
        rerunnable(run, k, trainer)
        work = _fresh_work(run, k, trainer)
        try:
            hashed = rerun(run, k, k, trainer, work)
            pm = _policy_manifest(run, k, trainer, work / "policy", hashed)
            run.store.put_dir(work / "policy", policy_rel(k + 1), move=True)
            run.store.write_manifest(policy_rel(k + 1), pm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _prune_states(run, k)  # the state before update k, kept for this until policy k+1 was on disk (record.py, step 8)
    prune_policies(run, k + 1)
    trainer.clean_after = k
    return trainer


def flush_state(run: Run, trainer: Trainer | None) -> None:
    """The warm trainer's state after the last update it published, written if it is not on disk
    yet: at the end of `iterate`, also on Ctrl-C or an error outside an update (a trainer stopped
    mid-update holds no iteration's state and writes nothing)."""
    record.check_none_in_flight(run, "the trainer's state")  # a record in flight is written from these weights: the loop waited
    k = getattr(trainer, "clean_after", None)
    if trainer is None or k is None or k < 0 or _has_state(run, k):
        return
    if not run.done(k, "update"):  # its background write failed before the record: the update is run again
        return
    work = _fresh_work(run, k, trainer)
    try:
        trainer.save_state(work / STATE)
        _barrier()
        fault_point("update:state", k)
        if trainer.rank == 0:
            seal(work / STATE, k)  # update k's manifest is written: the state names its own hash
            run.store.put_dir(work / STATE, state_rel(k), move=True)
            if run.policy_done(k + 1):  # else its write failed: `restore_policy` re-runs update k from the state before it
                _prune_states(run, k)
    finally:
        shutil.rmtree(work, ignore_errors=True)
