"""Policy retention (`train.keep_policies`): which stored policies keep their weights.

A real model's policy is large (SmolLM2-135M in fp32: 517 MB per iteration), so a run may keep
only the newest `last` policies and every `every`-th one, as TRL's `save_total_limit` does for
checkpoints. The default keeps every policy.

Pruning policy K removes its weight and tokenizer files but never its MANIFEST.json: the file
hashes and `policy_hash` stay, so `grpo audit` still checks the lineage through them. A
tombstone, policy/iter-K/PRUNED.json, says the files are gone on purpose; it is written before
any file is removed, so a prune killed midway is finished by the next one (pruning is
idempotent and always recomputes the kept set over all policies).

Never pruned: iter-0000 (the initial policy and, without `ref_model`, the reference), the
newest policy (what the next iteration samples from, and what resume needs with the newest
trainer state), with train.max_staleness s the s policies before it (the behaviour policies of
the rollouts still to come, one of which may be sampling right now), and a policy whose
evaluation is due and not yet done.
"""

from __future__ import annotations

from pipeline.errors import GRPOError
from pipeline.schedule import behaviour, eval_due
from pipeline.store import MANIFEST, TMP_MARK, policy_rel, stage_rel

TOMBSTONE = "PRUNED.json"


def kept(newest: int, last: int | None, every: int) -> set[int]:
    """Indices of the policies 0..newest that keep their files under (last, every)."""
    if last is None:
        return set(range(newest + 1))
    keep = {0, newest} | set(range(max(0, newest - last + 1), newest + 1))
    if every:
        keep |= set(range(0, newest + 1, every))
    return keep


def rule_text(last: int | None, every: int) -> str:
    """The setting as a person reads it, e.g. `keep_policies last 2, every 5`."""
    return f"train.keep_policies last {last}" + (f", every {every}" if every else "")


def is_pruned(run, k: int) -> bool:
    return run.store.exists(f"{policy_rel(k)}/{TOMBSTONE}")


def pruned_error(run, k: int, needed_by: str) -> GRPOError:
    """The one-line error for a stage that needs the weights of a pruned policy."""
    stone = run.store.read_json(f"{policy_rel(k)}/{TOMBSTONE}")
    names = run.store.listdir("policy")
    kept_now = ", ".join(
        str(int(n[5:])) for n in names
        if n.startswith("iter-") and n[5:].isdigit() and run.policy_done(int(n[5:])) and not is_pruned(run, int(n[5:]))
    )
    return GRPOError(
        f"{run.store.display(policy_rel(k))}: pruned by {stone.get('rule', 'train.keep_policies')} "
        f"(only its manifest and hashes remain); {needed_by} needs its weights"
        + (f"; policies with weights: {kept_now}" if kept_now else "")
    )


def prune_policies(run, newest: int) -> list[int]:
    """Remove the files of committed policies outside the kept set; returns those pruned now.

    Called by the update of iteration newest-1 after its manifest is written (policy `newest`
    is committed). A policy without a manifest is an interrupted attempt and left alone."""
    rule = run.cfg.train.keep_policies
    if rule.last is None:
        return []
    store = run.store
    # the policies still to sample an iteration (b(j) for j > newest) and still to be evaluated
    keep = kept(newest, rule.last, rule.every) | set(range(behaviour(run.cfg, newest), newest + 1))
    pruned = []
    for k in range(1, newest):
        if k in keep or (eval_due(run.cfg, k) and not run.done(k, "eval")):
            continue
        rel = policy_rel(k)
        if not store.exists(f"{rel}/{MANIFEST}"):
            continue
        leftovers = _files(store, rel)
        if not leftovers:
            continue
        if not store.exists(f"{rel}/{TOMBSTONE}"):
            store.write_json(f"{rel}/{TOMBSTONE}", {
                "policy": rel,
                "pruned_by": stage_rel(newest - 1, "update"),
                "rule": rule_text(rule.last, rule.every),
                "kept": sorted(keep),
                "files_removed": sorted(leftovers),
            })
        for name in leftovers:
            store.remove(f"{rel}/{name}")
        pruned.append(k)
    return pruned


def _files(store, rel: str) -> list[str]:
    """Files under a policy directory other than its manifest and tombstone."""
    root = store.path(rel)
    out = []
    for path in store.fs.find(root):
        name = path[len(root) + 1:]
        base = name.rsplit("/", 1)[-1]
        if base not in (MANIFEST, TOMBSTONE) and TMP_MARK not in base:
            out.append(name)
    return sorted(out)
