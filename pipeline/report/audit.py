"""`grpo audit`: check a run's record, every manifest, file hash and lineage link.

    grpo audit RUN                    # exit 0 and one summary line, or one line per problem
    grpo audit --compare RUN_A RUN_B  # the first artifact where two runs diverge (pipeline.report.compare)

Checked in lineage order (policy/iter-0000, iter-0000/{rollout,score,logprobs,eval,update},
policy/iter-0001, ...):

- policy/iter-K: each file's sha256 against its MANIFEST.json, no file missing or unlisted,
  `policy_hash` = hash of the file list; for K > 0 the lineage: written by iter-(K-1)/update
  from exactly the rollout/score/logprobs manifests of iteration K-1 (sha256 of their bytes),
  starting from policy K-1.
- a policy pruned by `train.keep_policies` (a PRUNED.json tombstone beside its manifest) is
  reported as pruned, not missing: its files are gone, but its manifest's `policy_hash` is
  still checked against its file list and still links the lineage; files left by a prune
  killed midway are still checked against their hashes.
- iter-K/<stage> for rollout, score, logprobs, eval: the stage, iteration, schema_version and
  config_hash fields; `input_hash` recomputed from `inputs`; every listed part's sha256, size,
  row count, Parquet kind + schema version and the stamp inside it; no unlisted part. Links:
  eval sampled from policy K, rollout from policy b(K) (pipeline/schedule.py); score and logprobs read exactly this rollout
  (its manifest's sha256 and its outputs) and have its rows, part by part; logprobs used policy K.
- iter-K/update: metrics.parquet (and old_logprobs.parquet when the update took the old logprobs
  from its own forward), its inputs (the three manifests and policy K) and the policy K+1 it wrote.
- a replayed stage (`grpo replay`) holds byte copies of the source run's parts, so its parts
  carry the source's stamp; while the source run exists its manifest must still have the
  sha256 recorded in `replayed_from`.

A directory without a manifest is an interrupted attempt that nothing counts (a policy whose
update has no manifest is one too): audit skips it and says how many it skipped, unless a
committed artifact links to it, which is a broken link.
"""

from __future__ import annotations

from pipeline.report.audit_lineage import check_policy, check_update
from pipeline.report.audit_parts import check_stage
from pipeline.report.audit_record import PART_STAGES, Audit, Auditor, short
from pipeline.store import MANIFEST, policy_rel, stage_rel
from pipeline.run.run import Run


def audit_run(run: Run, weights: bool = True) -> Audit:
    """Verify every manifest, file and lineage link of a run (see the module docstring); without
    `weights`, a policy's weight files may be absent (every other file and hash is still checked)."""
    a = Auditor(run, weights)
    policies = [int(n[5:]) for n in a.store.listdir("policy") if n.startswith("iter-") and n[5:].isdigit()]
    last = max(policies + run.iterations() + [0])
    for k in range(last + 1):
        _guarded(a, policy_rel(k), check_policy, a, k)
        for stage in PART_STAGES:
            _guarded(a, stage_rel(k, stage), check_stage, a, k, stage)
        _guarded(a, stage_rel(k, "update"), check_update, a, k)
    _check_code(a, run)
    a.audit.iterations = run.completed_iters()
    if a.config_mismatch:
        first = a.config_mismatch[0]
        a.audit.problems.insert(0, f"config.yaml: its hash {short(a.cfg_hash)} is not the one {len(a.config_mismatch)} manifest(s) were written with (first: {first}); was config.yaml edited?")
    return a.audit


def _check_code(a: Auditor, run: Run) -> None:
    """The run's copies of its reward, tool and environment code are the files recorded at `grpo init`."""
    from pipeline.errors import GRPOError
    from pipeline.store import code

    try:
        code.local_copies(run.store, run.code or {})
    except GRPOError as err:
        a.audit.problem(code.RECORD, str(err))


def _guarded(a: Auditor, rel: str, check, *args) -> None:
    """A hand-edited manifest can hold anything: a field of the wrong shape is a problem, not a crash."""
    try:
        check(*args)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        a.audit.problem(f"{rel}/{MANIFEST}", f"malformed ({type(err).__name__}: {err})")
