"""`grpo audit`'s lineage checks: each committed policy's files against its manifest and its
link to the update that wrote it, and each update's files, inputs and the policy it wrote. What is
checked and why: `pipeline.report.audit`'s docstring.
"""

from __future__ import annotations

from pipeline.report.audit_record import LINEAGE_STAGES, Auditor, short
from pipeline.store import MANIFEST, canonical_hash, policy_rel, stage_rel
from pipeline.run.retention import TOMBSTONE
from schemas.artifacts import OLD_LOGPROBS, UPDATE_METRICS


def check_policy(a: Auditor, k: int) -> None:
    """policy/iter-k: its files against its manifest, and its lineage to iter-(k-1)/update; records
    its hash in `a.policy` for the stages that link to it (so policies are checked in order)."""
    rel = policy_rel(k)
    committed = k == 0 or a.run.done(k - 1, "update")
    if not a.store.exists(rel):
        if k == 0:
            a.audit.problem(rel, "the initial policy is missing")
        return  # a missing later policy is reported by the update that should have written it
    if not committed:
        a.audit.skipped.append(rel)
        return
    m = a.manifest(rel)
    if m is None:
        if not a.store.exists(f"{rel}/{MANIFEST}"):  # update k-1 is done: the policy's (background) write did not finish
            a.audit.problem(rel, f"no MANIFEST.json: {a.run.unwritten(k)}" if k > 0 else "no MANIFEST.json")
        return
    a.audit.manifests += 1
    if m.stage != "policy" or m.iteration != k:
        a.audit.problem(f"{rel}/{MANIFEST}", f"describes {m.stage} iteration {m.iteration}, expected policy {k} (a swapped manifest?)")
        return
    files = m.files
    actual = a.tree(rel)
    pruned = TOMBSTONE in actual
    if pruned:  # train.keep_policies removed the weights; the hashes below still link it
        actual.pop(TOMBSTONE)
        a.audit.pruned.append(rel)
        if k == 0:
            a.audit.problem(f"{rel}/{TOMBSTONE}", "the initial policy is never pruned, yet it has a tombstone")
    a.audit.files += len(actual)
    if not a.weights and set(files) - set(actual):
        a.audit.weightless.append(rel)
    for name in sorted(set(files) | set(actual)):
        if name not in actual and (pruned or not a.weights):
            continue  # removed by the prune (a prune killed midway leaves some: still checked), or not copied
        if name not in actual:
            a.audit.problem(f"{rel}/{name}", "missing (listed in MANIFEST.json)")
        elif name not in files:
            a.audit.problem(f"{rel}/{name}", "not listed in MANIFEST.json")
        elif actual[name] != files[name]:
            a.audit.problem(f"{rel}/{name}", f"sha256 {short(actual[name])} differs from MANIFEST.json's {short(files[name])}")
    if canonical_hash(files) != m.policy_hash:
        a.audit.problem(f"{rel}/{MANIFEST}", "policy_hash is not the hash of its file list")
    a.policy[k] = m.policy_hash
    if k == 0:
        return
    lineage = m.lineage
    if lineage is None:
        a.audit.problem(f"{rel}/{MANIFEST}", f"no lineage (policy {k} must name the update of iteration {k - 1})")
        return
    if lineage.update_iteration != k - 1:
        a.audit.problem(f"{rel}/{MANIFEST}", f"lineage.update_iteration {lineage.update_iteration!r}, expected {k - 1}")
    for s in LINEAGE_STAGES:
        want = a.manifest_sha(stage_rel(k - 1, s))
        if lineage.inputs.get(s) != want:
            a.audit.problem(f"{rel}/{MANIFEST}", f"lineage.inputs.{s} does not match {stage_rel(k - 1, s)}/{MANIFEST}")
    if lineage.from_policy_hash != a.policy.get(k - 1):
        a.audit.problem(f"{rel}/{MANIFEST}", f"lineage.from_policy_hash does not match {policy_rel(k - 1)}")


def check_update(a: Auditor, k: int) -> None:
    """iter-k/update: its files, its inputs (iteration k's manifests, policy k), the policy k+1 it wrote."""
    if (opened := a.open_stage(k, "update")) is None:
        return
    sd, m = opened
    mrel = f"{sd}/{MANIFEST}"
    a.check_fields(mrel, m, "update", k, (UPDATE_METRICS.version, *UPDATE_METRICS.reads))
    if m.stage != "update":
        return
    files = {"metrics.parquet": m.outputs.metrics, OLD_LOGPROBS: m.outputs.old_logprobs}
    for name, listed in files.items():
        rel = f"{sd}/{name}"
        if listed is None:
            if a.store.exists(rel):
                a.audit.problem(rel, "not listed in MANIFEST.json")
        elif not a.store.exists(rel):
            a.audit.problem(rel, "missing (listed in MANIFEST.json)")
        else:
            sha, n = a.sha_file(rel)
            a.audit.files += 1
            if sha != listed.sha256 or n != listed.bytes:
                a.audit.problem(rel, f"sha256 {short(sha)} differs from MANIFEST.json's {short(listed.sha256)}")
    inputs = m.inputs
    for s in LINEAGE_STAGES:
        want = a.manifest_sha(stage_rel(k, s))
        if want is None:
            a.audit.problem(mrel, f"links to {stage_rel(k, s)}, which has no manifest")
        elif getattr(inputs, s) != want:
            a.audit.problem(mrel, f"inputs.{s} does not match {stage_rel(k, s)}/{MANIFEST}")
    want = a.committed_policy(k, mrel)
    if want is not None and inputs.policy_hash != want:
        a.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
    out_policy = m.outputs.policy
    nxt = policy_rel(k + 1)
    pm = a.manifest(nxt) if a.store.exists(nxt) else None
    if pm is None:
        a.audit.problem(mrel, f"wrote {nxt}, which is missing or has no manifest")
    elif out_policy.path != nxt or out_policy.policy_hash != pm.policy_hash:
        a.audit.problem(mrel, f"outputs.policy does not match {nxt}/{MANIFEST}")
