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
  eval sampled from policy K, rollout from policy b(K) (pipeline/staleness.py); score and logprobs read exactly this rollout
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

import hashlib
import io
from dataclasses import dataclass, field

import pyarrow.parquet as pq

from pipeline.store import parts
from pipeline.errors import GRPOError
from pipeline.store.retention import TOMBSTONE
from pipeline.store.run import Run
from pipeline.staleness import check_sampled_from
from pipeline.store import MANIFEST, TMP_MARK, RunStore, canonical_hash, hash_dir, policy_rel, stage_rel
from schemas.artifacts import BY_KIND, OLD_LOGPROBS, UPDATE_METRICS, SchemaError
from schemas.manifests import FileEntry, ReplayLink

PART_STAGES = ("rollout", "score", "logprobs", "eval")
LINEAGE_STAGES = ("rollout", "score", "logprobs")


def short(h: str | None) -> str:
    return (h or "none")[:12]


@dataclass
class Audit:
    """What `audit_run` found: problems (one line each, naming the artifact) and counts."""

    uri: str
    problems: list[str] = field(default_factory=list)
    manifests: int = 0
    files: int = 0
    iterations: int = 0
    skipped: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, rel: str, message: str) -> None:
        self.problems.append(f"{rel}: {message}")

    def summary(self) -> str:
        skipped = f"; {len(self.skipped)} interrupted attempt(s) without a manifest ignored" if self.skipped else ""
        if self.pruned:
            names = ", ".join(r.rsplit("/", 1)[-1] for r in self.pruned)
            skipped = f"; pruned by train.keep_policies (manifest and hashes kept, weights removed): {names}" + skipped
        if self.ok:
            return (f"audit {self.uri}: ok, {self.iterations} iteration(s), {self.manifests} manifests and "
                    f"{self.files} files verified, lineage intact{skipped}")
        return f"audit {self.uri}: {len(self.problems)} problem(s){skipped}"


class _Auditor:
    def __init__(self, run: Run):
        self.run, self.store = run, run.store
        self.cfg_hash = run.cfg_hash  # an unreadable or invalid config.yaml is a GRPOError here
        self.audit = Audit(run.store.display())
        self.policy: dict[int, str] = {}  # committed policies' recorded hashes
        self.config_mismatch: list[str] = []

    # -- helpers -------------------------------------------------------------------------
    def manifest(self, rel_dir: str):
        """The typed manifest, or None: absent, or unreadable / malformed (recorded as a problem)."""
        try:
            return self.store.manifest(rel_dir)
        except GRPOError as err:
            self.audit.problem(f"{rel_dir}/{MANIFEST}", str(err).removeprefix(f"{self.store.display(f'{rel_dir}/{MANIFEST}')}: "))
            return None

    def manifest_sha(self, rel_dir: str) -> str | None:
        return self.store.manifest_hash(rel_dir)

    def check_fields(self, rel: str, m, stage: str, k: int, version: int | tuple | None) -> None:
        if m.stage != stage:
            self.audit.problem(rel, f"manifest says stage {m.stage!r}, expected {stage!r} (a swapped manifest?)")
        if m.iteration != k:
            self.audit.problem(rel, f"manifest says iteration {m.iteration!r}, expected {k} (a swapped manifest?)")
        readable = version if isinstance(version, tuple) else (version,)
        if version is not None and getattr(m, "schema_version", None) not in readable:
            self.audit.problem(rel, f"schema_version {getattr(m, 'schema_version', None)!r}, this grpo reads version {readable[0]}")
        if getattr(m, "config_hash", None) != self.cfg_hash:
            self.config_mismatch.append(rel)

    def sha_file(self, rel: str) -> tuple[str, int]:
        h, n = hashlib.sha256(), 0
        with self.store.fs.open(self.store.path(rel), "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
                n += len(block)
        return h.hexdigest(), n

    def tree(self, rel: str) -> dict[str, str]:
        """sha256 of every file under a policy directory, as `hash_dir` lists them."""
        if self.store.local:
            return hash_dir(self.store.path(rel))
        root = self.store.path(rel)
        out = {}
        for path in sorted(self.store.fs.find(root)):
            name = path[len(root) + 1 :]
            base = name.rsplit("/", 1)[-1]
            if base != MANIFEST and TMP_MARK not in base and base != ".complete":
                out[name] = self.sha_file(f"{rel}/{name}")[0]
        return out

    def committed_policy(self, k: int, who: str) -> str | None:
        if k not in self.policy:
            self.audit.problem(who, f"links to {policy_rel(k)}, which has no committed manifest")
            return None
        return self.policy[k]

    # -- policies ------------------------------------------------------------------------
    def check_policy(self, k: int) -> None:
        rel = policy_rel(k)
        committed = k == 0 or self.run.done(k - 1, "update")
        if not self.store.exists(rel):
            if k == 0:
                self.audit.problem(rel, "the initial policy is missing")
            return  # a missing later policy is reported by the update that should have written it
        if not committed:
            self.audit.skipped.append(rel)
            return
        m = self.manifest(rel)
        if m is None:
            if not self.store.exists(f"{rel}/{MANIFEST}"):
                self.audit.problem(rel, "no MANIFEST.json")
            return
        self.audit.manifests += 1
        if m.stage != "policy" or m.iteration != k:
            self.audit.problem(f"{rel}/{MANIFEST}", f"describes {m.stage} iteration {m.iteration}, expected policy {k} (a swapped manifest?)")
            return
        files = m.files
        actual = self.tree(rel)
        pruned = TOMBSTONE in actual
        if pruned:  # train.keep_policies removed the weights; the hashes below still link it
            actual.pop(TOMBSTONE)
            self.audit.pruned.append(rel)
            if k == 0:
                self.audit.problem(f"{rel}/{TOMBSTONE}", "the initial policy is never pruned, yet it has a tombstone")
        self.audit.files += len(actual)
        for name in sorted(set(files) | set(actual)):
            if name not in actual and pruned:
                continue  # removed by the prune (a prune killed midway leaves some: still checked)
            if name not in actual:
                self.audit.problem(f"{rel}/{name}", "missing (listed in MANIFEST.json)")
            elif name not in files:
                self.audit.problem(f"{rel}/{name}", "not listed in MANIFEST.json")
            elif actual[name] != files[name]:
                self.audit.problem(f"{rel}/{name}", f"sha256 {short(actual[name])} differs from MANIFEST.json's {short(files[name])}")
        if canonical_hash(files) != m.policy_hash:
            self.audit.problem(f"{rel}/{MANIFEST}", "policy_hash is not the hash of its file list")
        self.policy[k] = m.policy_hash
        if k == 0:
            return
        lineage = m.lineage
        if lineage is None:
            self.audit.problem(f"{rel}/{MANIFEST}", f"no lineage (policy {k} must name the update of iteration {k - 1})")
            return
        if lineage.update_iteration != k - 1:
            self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.update_iteration {lineage.update_iteration!r}, expected {k - 1}")
        for s in LINEAGE_STAGES:
            want = self.manifest_sha(stage_rel(k - 1, s))
            if lineage.inputs.get(s) != want:
                self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.inputs.{s} does not match {stage_rel(k - 1, s)}/{MANIFEST}")
        if lineage.from_policy_hash != self.policy.get(k - 1):
            self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.from_policy_hash does not match {policy_rel(k - 1)}")

    # -- part stages ---------------------------------------------------------------------
    def open_stage(self, k: int, stage: str) -> tuple[str, object] | None:
        """The stage dir and its manifest, counted; None when the stage is absent or unfinished
        (recorded as skipped) or its manifest is unreadable (recorded as a problem)."""
        sd = stage_rel(k, stage)
        if not self.store.exists(sd):
            return None
        m = self.manifest(sd)
        if m is None:
            if not self.store.exists(f"{sd}/{MANIFEST}"):
                self.audit.skipped.append(sd)
            return None
        self.audit.manifests += 1
        return sd, m

    def check_stage(self, k: int, stage: str) -> None:
        if (opened := self.open_stage(k, stage)) is None:
            return
        sd, m = opened
        mrel = f"{sd}/{MANIFEST}"
        schema = BY_KIND[stage]
        self.check_fields(mrel, m, stage, k, (schema.version, *schema.reads))
        if m.stage not in PART_STAGES:
            return
        inputs = m.inputs
        if parts.input_hash(m.config_hash, stage, k, inputs) != m.input_hash:
            self.audit.problem(mrel, "input_hash is not the hash of its config and inputs")
        replayed = m.replayed_from
        stamp = replayed.input_hash if replayed else m.input_hash
        outputs = m.outputs
        for name, listed in sorted(outputs.items()):
            self.check_part(f"{sd}/{name}", name, listed, schema, stamp)
        if sum(o.rows or 0 for o in outputs.values()) != m.rows:
            self.audit.problem(mrel, f"rows {m.rows} is not the sum of its parts' rows")
        for name in self.store.listdir(sd):
            if name.startswith("part-") and name not in outputs:
                self.audit.problem(f"{sd}/{name}", "part not listed in MANIFEST.json")
        if stage in ("rollout", "eval"):
            check_sampled_from(self, k, m, mrel, stage)
        else:
            self.check_rollout_link(k, mrel, inputs.get("rollout") or {}, outputs)
        if stage == "logprobs":
            want = self.committed_policy(k, mrel)
            if want is not None and inputs.get("policy_hash") != want:
                self.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
        if replayed:
            self.check_replay(mrel, stage, replayed, outputs, inputs)

    def check_part(self, rel: str, name: str, listed: FileEntry, schema, stamp: str | None) -> None:
        if not self.store.exists(rel):
            self.audit.problem(rel, "missing (listed in MANIFEST.json)")
            return
        data = self.store.read_bytes(rel)
        self.audit.files += 1
        sha = hashlib.sha256(data).hexdigest()
        if sha != listed.sha256 or len(data) != listed.bytes:
            self.audit.problem(rel, f"sha256 {short(sha)} ({len(data)} bytes) differs from MANIFEST.json's {short(listed.sha256)} ({listed.bytes} bytes)")
            return
        try:
            f = pq.ParquetFile(io.BytesIO(data))
            schema.check(f.schema_arrow, rel)
        except SchemaError as err:
            self.audit.problem(rel, str(err).removeprefix(f"{rel}: "))
            return
        except Exception as err:  # pyarrow raises several types for a torn file
            self.audit.problem(rel, f"not a readable Parquet file ({str(err).splitlines()[0]})")
            return
        if f.metadata.num_rows != listed.rows:
            self.audit.problem(rel, f"{f.metadata.num_rows} rows, MANIFEST.json says {listed.rows}")
        meta = {k.decode(): v.decode() for k, v in (f.schema_arrow.metadata or {}).items()}
        if meta.get("grpo.input_hash") != stamp:
            self.audit.problem(rel, "stamped with another input_hash than its manifest's (a part of another attempt or run)")
        index = name[len("part-") : -len(".parquet")]
        if not index.isdigit() or meta.get("grpo.part") != str(int(index)):
            self.audit.problem(rel, f"stamped as part {meta.get('grpo.part')}, listed as {name}")

    def check_rollout_link(self, k: int, mrel: str, ref: dict, outputs: dict) -> None:
        rd = stage_rel(k, "rollout")
        rm = self.manifest(rd)
        if rm is None:
            self.audit.problem(mrel, f"links to {rd}, which has no manifest")
            return
        if ref.get("manifest_sha256") != self.manifest_sha(rd):
            self.audit.problem(mrel, f"inputs.rollout.manifest_sha256 does not match {rd}/{MANIFEST}")
        if ref.get("outputs_sha256") != parts.outputs_hash(rm):
            self.audit.problem(mrel, f"inputs.rollout.outputs_sha256 does not match the outputs of {rd}")
        rows = {n: o.rows for n, o in rm.outputs.items()}
        mine = {n: o.rows for n, o in outputs.items()}
        if rows != mine:
            self.audit.problem(mrel, f"its parts' rows {mine} differ from {rd}'s {rows}")

    def check_replay(self, mrel: str, stage: str, replayed: ReplayLink, outputs: dict, inputs: dict) -> None:
        link = replayed.model_dump(exclude={"input_hash"})
        if inputs.get("replayed_from") != link:
            self.audit.problem(mrel, "replayed_from differs from inputs.replayed_from")
        src = RunStore(replayed.run)
        src_dir = stage_rel(replayed.iteration, stage)
        try:
            src_sha = src.manifest_hash(src_dir)
        except Exception:  # the source may be gone or unreachable: this run is self-contained
            return
        if src_sha is None:
            return
        if src_sha != replayed.manifest_sha256:
            self.audit.problem(mrel, f"replayed_from: {src.display(src_dir)}/{MANIFEST} has changed since the replay")
            return
        src_out = {n: o.sha256 for n, o in src.manifest(src_dir).outputs.items()}
        if src_out != {n: o.sha256 for n, o in outputs.items()}:
            self.audit.problem(mrel, f"outputs are not the parts of {src.display(src_dir)}")

    # -- updates -------------------------------------------------------------------------
    def check_update(self, k: int) -> None:
        if (opened := self.open_stage(k, "update")) is None:
            return
        sd, m = opened
        mrel = f"{sd}/{MANIFEST}"
        self.check_fields(mrel, m, "update", k, UPDATE_METRICS.version)
        if m.stage != "update":
            return
        files = {"metrics.parquet": m.outputs.metrics, OLD_LOGPROBS: m.outputs.old_logprobs}
        for name, listed in files.items():
            rel = f"{sd}/{name}"
            if listed is None:
                if self.store.exists(rel):
                    self.audit.problem(rel, "not listed in MANIFEST.json")
            elif not self.store.exists(rel):
                self.audit.problem(rel, "missing (listed in MANIFEST.json)")
            else:
                sha, n = self.sha_file(rel)
                self.audit.files += 1
                if sha != listed.sha256 or n != listed.bytes:
                    self.audit.problem(rel, f"sha256 {short(sha)} differs from MANIFEST.json's {short(listed.sha256)}")
        inputs = m.inputs
        for s in LINEAGE_STAGES:
            want = self.manifest_sha(stage_rel(k, s))
            if want is None:
                self.audit.problem(mrel, f"links to {stage_rel(k, s)}, which has no manifest")
            elif getattr(inputs, s) != want:
                self.audit.problem(mrel, f"inputs.{s} does not match {stage_rel(k, s)}/{MANIFEST}")
        want = self.committed_policy(k, mrel)
        if want is not None and inputs.policy_hash != want:
            self.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
        out_policy = m.outputs.policy
        nxt = policy_rel(k + 1)
        pm = self.manifest(nxt) if self.store.exists(nxt) else None
        if pm is None:
            self.audit.problem(mrel, f"wrote {nxt}, which is missing or has no manifest")
        elif out_policy.path != nxt or out_policy.policy_hash != pm.policy_hash:
            self.audit.problem(mrel, f"outputs.policy does not match {nxt}/{MANIFEST}")

    # -- the whole run -------------------------------------------------------------------
    def guarded(self, rel: str, check, *args) -> None:
        """A hand-edited manifest can hold anything: a field of the wrong shape is a problem, not a crash."""
        try:
            check(*args)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            self.audit.problem(f"{rel}/{MANIFEST}", f"malformed ({type(err).__name__}: {err})")

    def run_all(self) -> Audit:
        policies = [int(n[5:]) for n in self.store.listdir("policy") if n.startswith("iter-") and n[5:].isdigit()]
        last = max(policies + self.run.iterations() + [0])
        for k in range(last + 1):
            self.guarded(policy_rel(k), self.check_policy, k)
            for stage in PART_STAGES:
                self.guarded(stage_rel(k, stage), self.check_stage, k, stage)
            self.guarded(stage_rel(k, "update"), self.check_update, k)
        self.audit.iterations = self.run.completed_iters()
        if self.config_mismatch:
            first = self.config_mismatch[0]
            self.audit.problems.insert(0, f"config.yaml: its hash {short(self.cfg_hash)} is not the one {len(self.config_mismatch)} manifest(s) were written with (first: {first}); was config.yaml edited?")
        return self.audit


def audit_run(run: Run) -> Audit:
    """Verify every manifest, file and lineage link of a run (see the module docstring)."""
    return _Auditor(run).run_all()
