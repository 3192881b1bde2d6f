"""`grpo audit --compare RUN_A RUN_B`: where two runs first diverge.

The configs first, then every artifact in lineage order by the sha256 its manifest records
(`pipeline.report.audit` checks that the files still match them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.report.audit_record import PART_STAGES, short
from pipeline.store import policy_rel, stage_rel
from pipeline.run.run import Run
from schemas.artifacts import OLD_LOGPROBS


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, v in tree.items():
            out.update(_flat(v, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(tree, sort_keys=True)}


def _artifacts(run: Run) -> list[tuple[str, str]]:
    """(artifact, content hash) in lineage order, from the manifests."""
    store = run.store
    policies = [int(n[5:]) for n in store.listdir("policy") if n.startswith("iter-") and n[5:].isdigit()]
    last = max(policies + run.iterations() + [0])
    out = []
    for k in range(last + 1):
        if run.policy_done(k):
            out.append((policy_rel(k), run.policy_hash(k)))
        for stage in PART_STAGES:
            m = run.manifest(k, stage)
            for name, o in sorted((m.outputs if m is not None else {}).items()):
                out.append((f"{stage_rel(k, stage)}/{name}", o.sha256))
        m = run.manifest(k, "update")
        if m is not None:
            if m.outputs.old_logprobs is not None:  # the old logprobs the update took from its forward
                out.append((f"{stage_rel(k, 'update')}/{OLD_LOGPROBS}", m.outputs.old_logprobs.sha256))
            out.append((f"{stage_rel(k, 'update')}/metrics.parquet", m.outputs.metrics.sha256))
    return out


@dataclass
class Comparison:
    a: str
    b: str
    config: str | None  # where the configs differ, or None
    first: str | None  # the first artifact that differs or exists in one run only, or None
    compared: int

    @property
    def same(self) -> bool:
        return self.config is None and self.first is None

    def lines(self) -> list[str]:
        if self.same:
            return [f"{self.a} and {self.b} agree: {self.compared} artifacts identical"]
        return [x for x in (self.config, self.first) if x]


def compare_runs(a: Run, b: Run) -> Comparison:
    """Where two runs first diverge: the config, then artifacts in lineage order (policy 0,
    iteration 0's rollout, score, logprobs parts, update metrics, policy 1, ...), by the
    sha256 their manifests record (`audit_run` checks that the files still match them)."""
    config = None
    if a.cfg_hash != b.cfg_hash:
        fa, fb = _flat(a.cfg.model_dump(mode="json")), _flat(b.cfg.model_dump(mode="json"))
        key = next(k for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k))
        config = f"config.yaml: differs at {key} ({fa.get(key, 'unset')} vs {fb.get(key, 'unset')})"
    arts_a, arts_b = dict(_artifacts(a)), dict(_artifacts(b))
    order = [name for name, _ in _artifacts(a)] + [name for name, _ in _artifacts(b) if name not in arts_a]
    first, compared = None, 0
    for name in order:
        ha, hb = arts_a.get(name), arts_b.get(name)
        if ha is None or hb is None:
            first = f"{name}: only in {a.store.display() if hb is None else b.store.display()}"
            break
        if ha != hb:
            first = f"{name}: differs (sha256 {short(ha)} vs {short(hb)})"
            break
        compared += 1
    return Comparison(a.store.display(), b.store.display(), config, first, compared)
