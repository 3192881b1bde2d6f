"""`grpo audit`'s checks of the part stages (rollout, score, logprobs, eval): the manifest's
fields and input_hash, every listed part (sha256, size, rows, Parquet schema, stamp), no unlisted
part, the links to the policy and the rollout, and a replay's link to its source run. What is
checked and why: `pipeline.report.audit`'s docstring.
"""

from __future__ import annotations

import hashlib
import io

import pyarrow.parquet as pq

from pipeline.eval.metrics import FIGURES_VERSION, figures
from pipeline.report.audit_episodes import check_episodes
from pipeline.report.audit_record import PART_STAGES, Auditor, short
from pipeline.report.audit_verdicts import check_verdicts
from pipeline.run import parts
from pipeline.store import MANIFEST, RunStore, policy_rel, stage_rel
from schemas.artifacts import BY_KIND, SchemaError
from pipeline.schedule import behaviour, staleness
from schemas.manifests import FileEntry, ReplayLink


def check_stage(a: Auditor, k: int, stage: str) -> None:
    """iter-k/<stage> (rollout, score, logprobs, eval), its parts and its links, into `a.audit`."""
    if (opened := a.open_stage(k, stage)) is None:
        return
    sd, m = opened
    mrel = f"{sd}/{MANIFEST}"
    schema = BY_KIND[stage]
    a.check_fields(mrel, m, stage, k, (schema.version, *schema.reads))
    if m.stage not in PART_STAGES:
        return
    inputs = m.inputs
    if parts.input_hash(m.config_hash, stage, k, inputs) != m.input_hash:
        a.audit.problem(mrel, "input_hash is not the hash of its config and inputs")
    replayed = m.replayed_from
    stamp = replayed.input_hash if replayed else m.input_hash
    outputs = m.outputs
    for name, listed in sorted(outputs.items()):
        _check_part(a, f"{sd}/{name}", name, listed, schema, stamp)
    if sum(o.rows or 0 for o in outputs.values()) != m.rows:
        a.audit.problem(mrel, f"rows {m.rows} is not the sum of its parts' rows")
    for name in a.store.listdir(sd):
        if name.startswith("part-") and name not in outputs:
            a.audit.problem(f"{sd}/{name}", "part not listed in MANIFEST.json")
    if stage in ("score", "eval"):
        check_verdicts(a, sd, m)
    if stage == "eval" and m.metrics is not None:
        _check_figures(a, k, m, mrel)
    if stage in ("rollout", "eval"):
        check_sampled_from(a, k, m, mrel, stage)
    else:
        _check_rollout_link(a, k, mrel, inputs.get("rollout") or {}, outputs)
    if stage == "logprobs":
        want = a.committed_policy(k, mrel)
        if want is not None and inputs.get("policy_hash") != want:
            a.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
    if replayed:
        _check_replay(a, mrel, stage, replayed, outputs, inputs)


def _check_figures(a: Auditor, k: int, m, mrel: str) -> None:
    """The eval manifest's figures are its parts' (pipeline/eval/metrics.py), recomputed."""
    import math

    import pyarrow as pa

    from pipeline.run.parts import read_parts
    from schemas.artifacts import EVAL

    seen, notes = m.observed, {}  # the scored samples' range the eval's intervals took (observed.py), checked below
    try:
        figs = figures(a.run.cfg, pa.concat_tables(read_parts(a.run, k, "eval", EVAL), promote_options="default"),
                       seen and seen.get("ranges"), notes)
    except Exception as err:
        sd = mrel.rsplit("/", 1)[0]
        if not any(p.startswith(f"{sd}/part-") for p in a.audit.problems):  # else _check_part named the part
            why = (str(err).splitlines() or [""])[0]
            a.audit.problem(mrel, f"metrics: cannot be recomputed from its parts ({type(err).__name__}: {why})")
        return
    current = m.figures_version == FIGURES_VERSION  # an older record: only the values whose definition held
    for name, rec in sorted(m.metrics.items()):
        if (m.figures_version or 1) < 2 and name.rsplit("/", 1)[-1].startswith("maj_at_"):  # first-k maj@k then
            continue
        got = figs.get(name)
        if got is None or not all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) or (x != x and y != y)
                                  for x, y in zip((rec["value"], rec["lo"], rec["hi"])[:3 if current else 1], got)):
            a.audit.problem(mrel, f"metrics.{name} {rec} is not what its parts give ({got})")
    if current and (m.no_interval or {}) != notes:
        a.audit.problem(mrel, f"no_interval {m.no_interval} is not what its parts give ({notes})")
    if current and seen and all(a.run.done(j, "score") for j in seen.get("iterations", [])):
        from pipeline.eval.observed import observed

        if observed(a.run, seen["iterations"]) != seen:
            a.audit.problem(mrel, f"observed {seen} is not what the score parts of iterations {seen.get('iterations')} give")


def _check_part(a: Auditor, rel: str, name: str, listed: FileEntry, schema, stamp: str | None) -> None:
    if not a.store.exists(rel):
        a.audit.problem(rel, "missing (listed in MANIFEST.json)")
        return
    data = a.store.read_bytes(rel)
    a.audit.files += 1
    sha = hashlib.sha256(data).hexdigest()
    if sha != listed.sha256 or len(data) != listed.bytes:
        a.audit.problem(rel, f"sha256 {short(sha)} ({len(data)} bytes) differs from MANIFEST.json's {short(listed.sha256)} ({listed.bytes} bytes)")
        return
    try:
        f = pq.ParquetFile(io.BytesIO(data))
        schema.check(f.schema_arrow, rel)
    except SchemaError as err:
        a.audit.problem(rel, str(err).removeprefix(f"{rel}: "))
        return
    except Exception as err:  # pyarrow raises several types for a torn file
        a.audit.problem(rel, f"not a readable Parquet file ({str(err).splitlines()[0]})")
        return
    if f.metadata.num_rows != listed.rows:
        a.audit.problem(rel, f"{f.metadata.num_rows} rows, MANIFEST.json says {listed.rows}")
    meta = {k.decode(): v.decode() for k, v in (f.schema_arrow.metadata or {}).items()}
    if meta.get("grpo.input_hash") != stamp:
        a.audit.problem(rel, "stamped with another input_hash than its manifest's (a part of another attempt or run)")
    index = name[len("part-") : -len(".parquet")]
    if not index.isdigit() or meta.get("grpo.part") != str(int(index)):
        a.audit.problem(rel, f"stamped as part {meta.get('grpo.part')}, listed as {name}")
    if schema.kind in ("rollout", "eval"):
        check_episodes(a, rel, data)  # an episode row's ids, re-derived from its record


def _check_rollout_link(a: Auditor, k: int, mrel: str, ref: dict, outputs: dict) -> None:
    rd = stage_rel(k, "rollout")
    rm = a.manifest(rd)
    if rm is None:
        a.audit.problem(mrel, f"links to {rd}, which has no manifest")
        return
    if ref.get("manifest_sha256") != a.manifest_sha(rd):
        a.audit.problem(mrel, f"inputs.rollout.manifest_sha256 does not match {rd}/{MANIFEST}")
    if ref.get("outputs_sha256") != parts.outputs_hash(rm):
        a.audit.problem(mrel, f"inputs.rollout.outputs_sha256 does not match the outputs of {rd}")
    rows = {n: o.rows for n, o in rm.outputs.items()}
    mine = {n: o.rows for n, o in outputs.items()}
    if rows != mine:
        a.audit.problem(mrel, f"its parts' rows {mine} differ from {rd}'s {rows}")


def _check_replay(a: Auditor, mrel: str, stage: str, replayed: ReplayLink, outputs: dict, inputs: dict) -> None:
    link = replayed.model_dump(exclude={"input_hash"})
    if inputs.get("replayed_from") != link:
        a.audit.problem(mrel, "replayed_from differs from inputs.replayed_from")
    src = RunStore(replayed.run)
    src_dir = stage_rel(replayed.iteration, stage)
    try:
        src_sha = src.manifest_hash(src_dir)
    except Exception:  # the source may be gone or unreachable: this run is self-contained
        return
    if src_sha is None:
        return
    if src_sha != replayed.manifest_sha256:
        a.audit.problem(mrel, f"replayed_from: {src.display(src_dir)}/{MANIFEST} has changed since the replay")
        return
    src_out = {n: o.sha256 for n, o in src.manifest(src_dir).outputs.items()}
    if src_out != {n: o.sha256 for n, o in outputs.items()}:
        a.audit.problem(mrel, f"outputs are not the parts of {src.display(src_dir)}")


def check_sampled_from(auditor, k: int, m, mrel: str, stage: str) -> None:
    """audit: a rollout (eval) of iteration k names its behaviour policy b(k) (policy k) by the
    hash that policy's manifest records, and a rollout records its staleness k - b(k)."""
    cfg = auditor.run.cfg
    b = behaviour(cfg, k) if stage == "rollout" and m.replayed_from is None else k  # a replay's iteration 0 is policy 0's
    policy = m.inputs.get("policy") or {}
    want = auditor.committed_policy(b, mrel)
    if want is not None and (policy.get("policy_hash") != want or (m.policy_hash or want) != want):
        auditor.audit.problem(mrel, f"inputs.policy.policy_hash {(policy.get('policy_hash') or 'none')[:12]} "
                                    f"does not match {policy_rel(b)} ({want[:12]})")
    if stage == "rollout" and m.replayed_from is None and m.staleness != staleness(cfg, k):
        auditor.audit.problem(mrel, f"staleness {m.staleness!r}, expected {staleness(cfg, k)!r} "
                                    f"(train.max_staleness {cfg.train.max_staleness}: sampled from {policy_rel(b)})")
