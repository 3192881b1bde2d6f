"""What update k leaves in the run, in the order that keeps every kill resumable.

`publish` runs on rank 0 once update k has trained and saved policy k+1 into its scratch
directory. Saving it returned either {file: sha256} (the weights written and hashed: the record
is written here, inline) or a `DeferredWeights` (`iterate`, `save_policy` decides: the weights file is
not written yet, and the record's last steps go to a thread while rollout k+1 runs).

The steps, one numbering for both ways (the code's comments follow it):
1. (thread only) policy k+1's write lock taken (`inflight.acquire`): held until step 7;
2. policy k+1's directory moved into the run; inline, its MANIFEST.json too: the policy exists;
   -- a kill after it (`update:publish`) leaves update k undone: it is run again, over the policy;
3. the trainer state (where one is due), update k's metrics and old logprobs;
Inline, then:
5. update k's MANIFEST.json: update k is done;
8. older trainer states and policies pruned (train.keep_states, keep_policies).
On the thread (`_write_later`), while rollout k+1 runs:
4. the sampler proof's reference, from the tensors the file is written from, and the file's sha256,
   in memory over exactly the bytes it will hold;
   -- a kill here (`update:record`) leaves update k undone: nothing names the hash;
5. update k's MANIFEST.json naming it: update k is done (the `hash` future settles);
6. the weights file, synced, renamed into place, its directory synced;
   -- a kill during it, or after it (`update:write`), leaves update k done and policy k+1 missing:
   `publish.restore_policy` re-runs update k from the state before it and checks the hash;
7. policy k+1's MANIFEST.json: the policy exists; the lock released;
8. older trainer states (kept until now for that re-run) and policies pruned; the thread ends and
   the `files` future settles (a failed prune reaches its reader as the write's error).
Until the thread ends:
- the master's tensors the file is written from must not change: the loop settles the write
  before update k+1 (`settle_before_update`, timed), and before the trainer closes; what changes
  or reads them (an update, the trainer's state) checks that it did (`check_none_in_flight`);
- a question about update k or policy k+1 waits through `Run.settle` (pipeline/run/inflight.py);
  tracking reads `Run.unwaited`, which never waits;
- another process sees the write's lock: it waits before update k (`wait_for_other_writer`) and
  never re-creates policy k+1 beside it (`recreating`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa

from pipeline.errors import GRPOError
from pipeline.run import inflight
from pipeline.run.retention import prune_policies
from pipeline.run.run import Run, policy_manifest, with_hashed
from pipeline.run.sampler_proof import reference_meanwhile, remember
from pipeline.run.weights_file import DeferredWeights
from pipeline.store import canonical_hash, hash_dir, policy_rel, stage_rel
from pipeline.store.faults import fault_point
from pipeline.update.stored_state import state_rel
from pipeline.update.trainer import TRAINER_JSON, STATE
from schemas.artifacts import LOGPROBS, OLD_LOGPROBS, UPDATE_METRICS
from schemas.manifests import FileEntry, Lineage, PolicyManifest, PolicyRef, UpdateInputs, UpdateManifest, UpdateOutputs

log = logging.getLogger("grpo.update")
_WARNED: list = []


def save_policy(run: Run, k: int, trainer, work: Path, readers_here: bool):
    """Policy k+1 saved into `work`/policy (every rank), what `publish` is then handed: {file: sha256},
    or the `DeferredWeights` of its weights file. The one place that decides whether update k's
    record goes to a thread: every reader of policy k+1's files must be in this process
    (`readers_here`: `iterate`'s sampler is), with one rank, on a local run, and saving must then
    stream the weights (unsharded fp32 weights do, run/weights_file.save_fp32_policy; a sharded or
    non-fp32 model goes through save_pretrained, and a LoRA adapter is small: both are written at once)."""
    later = readers_here and trainer.world == 1 and run.store.local
    return trainer.save_policy(work / "policy", run.policy_dir(k), work / STATE, later)


def settle_before_update(run: Run, k: int | None) -> float:
    """The loop's wait before update k changes the master's tensors (or the trainer holding them is
    closed): the write in flight from them finished, its error raised (whichever is in flight:
    policy k's, as the loop calls it; `k` names the update for a reader). Returns the seconds waited."""
    t = time.time()
    run.settle(None, "files")
    return time.time() - t


def check_none_in_flight(run: Run, what: str) -> None:
    """`what` (an update, the trainer's state) is about to change or read the master's tensors: no
    write from them may be in flight here. Never waits: the loop has waited (`settle_before_update`)."""
    if run.store.local and (j := run.completed_iters()) > 0 and run.writing(j) is not None:
        raise RuntimeError(f"{what}: policy {j}'s record is still being written from the master's tensors; "
                           "the loop settles it first (record.settle_before_update)")


def wait_for_other_writer(run: Run, k: int) -> None:
    """Before update k runs (its lock held): where another process's `iterate` is still writing
    policy k+1 (update k's record, on its thread), wait for it (at most 600 s) to end."""
    if run.store.local and inflight.held(run.store.root, k + 1):
        with inflight.hold(run.store.root, k + 1, wait=600):
            pass


def recreating(run: Run, k: int):
    """Policy k+1's write lock for a block that re-creates it (`publish.restore_policy`), else a
    one-line error: another process's write of it may still run (a second `iterate`): refused, never raced."""
    return inflight.hold(run.store.root, k + 1) if run.store.local else contextlib.nullcontext()


def publish(run: Run, k: int, trainer, data, rows, work: Path, t0: float, train_s: float, state_hash: Future | None,
            saved: dict[str, str] | DeferredWeights) -> UpdateManifest | None:
    """Update k's record (rank 0), steps 1-8 of the module's list. `saved`: what saving policy k+1 into `work`/policy
    returned: {file: sha256} (the record written here; update k's manifest returned), or the
    `DeferredWeights` of its weights file (steps 4-8 on a thread; None returned: `Run.manifest`
    settles it)."""
    store, sd = run.store, stage_rel(k, "update")
    later = isinstance(saved, DeferredWeights)
    hashed = {} if later else saved
    # before update k's manifest: no moment another process could take the write for an interrupted one (restore_policy)
    lock = inflight.acquire(store.root, k + 1, wait=30) if later else None  # released by the writing thread
    try:
        reference = reference_meanwhile(work / "policy") if later else None  # built here: not thread-safe
        pm, body, state = _move_in(run, k, trainer, data, rows, work, t0, train_s, state_hash, hashed, later)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if later:
        _write_later(run, k, pm, body, saved, lock, reference, state)
        return None
    manifest = store.write_manifest(sd, body(pm))
    _pruned(run, k, state)
    return manifest


def _move_in(run: Run, k: int, trainer, data, rows, work: Path, t0: float, train_s: float, state_hash: Future | None,
             hashed: dict[str, str], later: bool):
    """Steps 2-3: (policy k+1's manifest, update k's manifest as a function of it, whether a state
    was stored). `later`: policy k+1's manifest still lacks its weights file."""
    store, sd = run.store, stage_rel(k, "update")
    try:
        inputs = {s: store.manifest_hash(stage_rel(k, s)) for s in ("rollout", "score", "logprobs")}
        pm = policy_manifest_of(run, k, trainer, work / "policy", hashed)
        lineage = pm.lineage
        store.put_dir(work / "policy", policy_rel(k + 1), move=True)  # later: without its weights file yet
        if not later:
            store.write_manifest(policy_rel(k + 1), pm)
        fault_point("update:publish", k)
        state = state_hash.result() if state_hash is not None else None  # before the state is moved under the hashing thread
        if state is not None:
            store.put_dir(work / STATE, state_rel(k), move=True)
        metrics = store.write_table(f"{sd}/metrics.parquet", metrics_table(rows), UPDATE_METRICS)
        old_lp = store.write_table(f"{sd}/{OLD_LOGPROBS}", data.old_table(), LOGPROBS) if data.old_from_update else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    prev_state, seconds = prev_state_hash(run, k), round(time.time() - t0, 3)

    def body(pm) -> UpdateManifest:
        return UpdateManifest(
            stage="update", iteration=k, schema_version=UPDATE_METRICS.version, config_hash=run.cfg_hash, seed=run.cfg.seed,
            inputs=UpdateInputs(**inputs, policy_hash=lineage.from_policy_hash, state=prev_state),
            outputs=UpdateOutputs(metrics=FileEntry(**metrics.as_dict()), policy=PolicyRef(path=policy_rel(k + 1), policy_hash=pm.policy_hash),
                                  old_logprobs=FileEntry(**old_lp.as_dict()) if old_lp is not None else None, state=state),
            policy_hash=pm.policy_hash, rows=data.size, optimizer_steps=len(rows), global_step=trainer.global_step,
            kl_coef=trainer.kl_ctl.coef, world_size=trainer.world, precision=trainer.precision, state_every=run.cfg.train.state_every,
            timings={"seconds": seconds, "train_s": round(train_s, 3)},
        )

    return pm, body, state is not None


def _write_later(run: Run, k: int, pm: PolicyManifest, body, weights: DeferredWeights, lock, reference, state: bool) -> None:
    """Steps 4-8 on a thread (`inflight.start`), while rollout k+1 runs. `lock`: policy k+1's write
    lock, held; `reference`: `sampler_proof.reference_meanwhile`'s function, or None."""
    store = run.store
    where = store.display(policy_rel(k + 1))
    target = store.local_dir(policy_rel(k + 1)) / weights.path.name

    def write(p: inflight.Inflight) -> None:
        try:
            probe = _reference(reference, weights, where)
            final = with_hashed(pm, {weights.path.name: weights.hash()})  # 4
            remember(final.policy_hash, probe)  # before the hash settles: the proof of policy k+1 finds it
            fault_point("update:record", k)
            try:  # 5
                store.write_manifest(stage_rel(k, "update"), body(final))
            except OSError as err:  # the update is not done (run again): one line, where the record is settled
                raise GRPOError(f"{store.display(stage_rel(k, 'update'))}: write failed: {err.strerror or err}") from None
            p.record(final.policy_hash)
            try:  # 6
                weights.write(target)
            except OSError as err:  # raised again, as one line, where the policy is next settled
                raise GRPOError(f"{where}: write failed: {err.strerror or err}") from None
            fault_point("update:write", k)
            store.write_manifest(policy_rel(k + 1), final)  # 7
        finally:
            lock.release()
        _pruned(run, k, state)  # 8

    try:
        inflight.start(store.root, k + 1, write)
    except BaseException:  # the thread never ran `write`: its lock released here (update k stays undone)
        lock.release()
        raise


def _reference(reference, weights: DeferredWeights, where: str):
    """The sampler proof's reference of policy k+1 from the tensors its file is written from;
    None where it cannot be computed here (the proof computes it from the stored file instead)."""
    try:
        return reference(weights.tensors, where) if reference is not None else None
    except Exception as err:  # noqa: BLE001
        if not _WARNED:  # once a process: a slower proof, not a wrong one
            _WARNED.append(True)  # not the error: its traceback would hold this write's tensors
            first = (str(err).strip().splitlines() or [""])[0][:200]
            log.warning(f"warning: {where}: the sampler proof's reference could not be computed beside the write "
                        f"({type(err).__name__}: {first}); it is computed from the stored file instead, after the write")
        return None


def _pruned(run: Run, k: int, state: bool) -> None:
    """Step 8. Not before policy k+1's manifest: until then a kill re-runs update k from the state before it."""
    if state:
        prune_states(run, k)
    prune_policies(run, k + 1)  # train.keep_policies; policy k+1 and iter-0000 always stay


# -- the pieces of the record, also what `publish.restore_policy` and `flush_state` write ----------
def has_state(run: Run, k: int) -> bool:
    return run.store.exists(f"{state_rel(k)}/{TRAINER_JSON}")


def prune_states(run: Run, k: int) -> None:
    """Keep only the newest `train.keep_states` trainer states up to iteration k (they are large)."""
    have = [i for i in range(k + 1) if has_state(run, i)]
    for old in have[: -run.cfg.train.keep_states]:
        run.store.remove(state_rel(old), recursive=True)


def prev_state_hash(run: Run, k: int) -> str | None:
    """The hash of the state update k-1 recorded when it wrote it (None where none was due); hashed
    again only for a run written before updates recorded it (and wrote one every time)."""
    if k == 0:
        return None
    prev = run.manifest(k - 1, "update")
    if prev.outputs.state is not None or prev.state_every is not None:
        return prev.outputs.state
    return canonical_hash(hash_dir(run.store.local_dir(state_rel(k - 1)))) if has_state(run, k - 1) else None


def policy_manifest_of(run: Run, k: int, trainer, policy_dir: Path, hashed: dict[str, str]) -> PolicyManifest:
    """Policy k+1's manifest, as update k writes it (and `restore_policy` again)."""
    inputs = {s: run.store.manifest_hash(stage_rel(k, s)) for s in ("rollout", "score", "logprobs")}
    lineage = Lineage(update_iteration=k, inputs=inputs, from_policy_hash=run.policy_hash(k))
    return policy_manifest(policy_dir, k + 1, source=f"update of {stage_rel(k, 'update')}", lineage=lineage, hashed=hashed,
                           adapter=trainer.policy.manifest(run))


def metrics_table(rows: list[dict]) -> pa.Table:
    names = UPDATE_METRICS.schema.names
    return pa.table({n: [r.get(n) for r in rows] for n in names}) if rows else UPDATE_METRICS.schema.empty_table()
