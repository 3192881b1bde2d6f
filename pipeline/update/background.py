"""The record of `iterate`'s update written on a thread while the next rollout runs
(pipeline.update.publish, pipeline.store.pending): what the sampler needs it already has in memory;
what a resume needs is hashed and written here, in the order that keeps every kill resumable."""

from __future__ import annotations

import logging
from typing import Callable

from pipeline.errors import GRPOError
from pipeline.run.retention import prune_policies
from pipeline.run.run import Run, with_hashed
from pipeline.run.sampler_proof import REFERENCE
from pipeline.run.weights_file import DeferredWeights
from pipeline.store import pending, policy_rel, stage_rel
from pipeline.store.faults import fault_point
from schemas.manifests import PolicyManifest, UpdateManifest

log = logging.getLogger("grpo.update")
_WARNED: list = []


def write_later(run: Run, k: int, pm: PolicyManifest, body: Callable[[PolicyManifest], UpdateManifest], weights: DeferredWeights,
                lock, reference, after_policy: Callable[[], None] | None = None) -> None:
    """On a thread, while rollout k+1 runs: the sampler proof's reference of policy k+1 (`reference`,
    from the same tensors), the weights file's sha256 (in memory), update k's manifest naming it
    (update k is done; whoever asks waits for it), then the weights file into policy k+1's directory
    (already in the run with its tokenizer and config), then its MANIFEST.json (then `lock` is
    released: pending.acquire), then retention. `pm`: policy k+1's manifest without the weights file;
    `body`: update k's manifest naming a policy manifest; `lock`: policy k+1's write lock, held;
    `reference`: `sampler_proof.reference_meanwhile`'s function, or None; `after_policy`: run once
    policy k+1's manifest is written (the pruning of older trainer states: until then a kill leaves
    policy k+1 to `restore_policy`, which re-runs update k from the state before it)."""
    store = run.store
    where = store.display(policy_rel(k + 1))
    target = store.local_dir(policy_rel(k + 1)) / weights.path.name

    def write(p: pending.Pending) -> None:
        try:
            try:  # a reference that cannot be computed here is computed from the file by the proof itself
                p.put(REFERENCE, reference(weights.tensors, where) if reference is not None else None)
            except Exception as err:  # noqa: BLE001
                p.put(REFERENCE, None)
                if not _WARNED:  # once a process: a slower proof, not a wrong one
                    _WARNED.append(True)  # not the error: its traceback would hold this write's tensors
                    first = (str(err).strip().splitlines() or [""])[0][:200]
                    log.warning(f"warning: {where}: the sampler proof's reference could not be computed beside the write "
                                f"({type(err).__name__}: {first}); it is computed from the stored file instead, after the write")
            final = with_hashed(pm, {weights.path.name: weights.hash()})
            fault_point("update:record", k)
            try:
                store.write_manifest(stage_rel(k, "update"), body(final))
            except OSError as err:  # the update is not done (run again): one line, where the record is waited for
                raise GRPOError(f"{store.display(stage_rel(k, 'update'))}: write failed: {err.strerror or err}") from None
            p.record(final.policy_hash)
            try:
                weights.write(target)
            except OSError as err:  # raised again, as one line, where the policy is next waited for
                raise GRPOError(f"{where}: write failed: {err.strerror or err}") from None
            fault_point("update:write", k)
            store.write_manifest(policy_rel(k + 1), final)
        finally:
            lock.release()
        if after_policy is not None:  # not before: a kill before the policy's manifest re-runs update k from the state before it
            after_policy()
        prune_policies(run, k + 1)  # train.keep_policies, once policy k+1 is on disk; it and iter-0000 always stay

    pending.start(store.root, k + 1, write)
