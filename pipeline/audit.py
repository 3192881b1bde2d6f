"""`grpo audit`: check a run's record, every manifest, file hash and lineage link.

    grpo audit RUN                    # exit 0 and one summary line, or one line per problem
    grpo audit --compare RUN_A RUN_B  # the first artifact where two runs diverge

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
  rollout and eval were sampled from policy K; score and logprobs read exactly this rollout
  (its manifest's sha256 and its outputs) and have its rows, part by part; logprobs used policy K.
- iter-K/update: metrics.parquet, its inputs (the three manifests and policy K) and the policy
  K+1 it wrote.
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
import json
from dataclasses import dataclass, field

import pyarrow.parquet as pq

from pipeline import parts
from pipeline.errors import GRPOError
from pipeline.retention import TOMBSTONE
from pipeline.run import Run
from pipeline.store import MANIFEST, TMP_MARK, RunStore, canonical_hash, hash_dir, policy_rel, stage_rel
from schemas.artifacts import BY_KIND, UPDATE_METRICS, SchemaError

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
    def manifest(self, rel_dir: str) -> dict | None:
        try:
            m = self.store.manifest(rel_dir)
        except GRPOError:
            self.audit.problem(f"{rel_dir}/{MANIFEST}", "not valid JSON")
            return None
        if m is not None and not isinstance(m, dict):
            self.audit.problem(f"{rel_dir}/{MANIFEST}", "not a JSON object")
            return None
        return m

    def manifest_sha(self, rel_dir: str) -> str | None:
        return self.store.manifest_hash(rel_dir)

    def check_fields(self, rel: str, m: dict, stage: str, k: int, version: int | None) -> None:
        if m.get("stage") != stage:
            self.audit.problem(rel, f"manifest says stage {m.get('stage')!r}, expected {stage!r} (a swapped manifest?)")
        if m.get("iteration") != k:
            self.audit.problem(rel, f"manifest says iteration {m.get('iteration')!r}, expected {k} (a swapped manifest?)")
        if version is not None and m.get("schema_version") != version:
            self.audit.problem(rel, f"schema_version {m.get('schema_version')!r}, this grpo reads version {version}")
        if m.get("config_hash") != self.cfg_hash:
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
        if m.get("stage") != "policy" or m.get("iteration") != k:
            self.audit.problem(f"{rel}/{MANIFEST}", f"describes {m.get('stage')} iteration {m.get('iteration')}, expected policy {k} (a swapped manifest?)")
        files = m.get("files") or {}
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
        if canonical_hash(files) != m.get("policy_hash"):
            self.audit.problem(f"{rel}/{MANIFEST}", "policy_hash is not the hash of its file list")
        self.policy[k] = m.get("policy_hash")
        if k == 0:
            return
        lineage = m.get("lineage") or {}
        if lineage.get("update_iteration") != k - 1:
            self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.update_iteration {lineage.get('update_iteration')!r}, expected {k - 1}")
        for s in LINEAGE_STAGES:
            want = self.manifest_sha(stage_rel(k - 1, s))
            if (lineage.get("inputs") or {}).get(s) != want:
                self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.inputs.{s} does not match {stage_rel(k - 1, s)}/{MANIFEST}")
        if lineage.get("from_policy_hash") != self.policy.get(k - 1):
            self.audit.problem(f"{rel}/{MANIFEST}", f"lineage.from_policy_hash does not match {policy_rel(k - 1)}")

    # -- part stages ---------------------------------------------------------------------
    def open_stage(self, k: int, stage: str) -> tuple[str, dict] | None:
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
        self.check_fields(mrel, m, stage, k, schema.version)
        inputs = m.get("inputs") or {}
        if parts.input_hash(m.get("config_hash"), stage, k, inputs) != m.get("input_hash"):
            self.audit.problem(mrel, "input_hash is not the hash of its config and inputs")
        replayed = m.get("replayed_from")
        stamp = replayed.get("input_hash") if replayed else m.get("input_hash")
        outputs = m.get("outputs") or {}
        for name, listed in sorted(outputs.items()):
            self.check_part(f"{sd}/{name}", name, listed, schema, stamp)
        if sum(o.get("rows", 0) for o in outputs.values()) != m.get("rows"):
            self.audit.problem(mrel, f"rows {m.get('rows')} is not the sum of its parts' rows")
        for name in self.store.listdir(sd):
            if name.startswith("part-") and name not in outputs:
                self.audit.problem(f"{sd}/{name}", "part not listed in MANIFEST.json")
        if stage in ("rollout", "eval"):
            policy = inputs.get("policy") or {}
            want = self.committed_policy(k, mrel)
            if want is not None and (policy.get("policy_hash") != want or m.get("policy_hash", want) != want):
                self.audit.problem(mrel, f"inputs.policy.policy_hash {short(policy.get('policy_hash'))} does not match {policy_rel(k)} ({short(want)})")
        else:
            self.check_rollout_link(k, mrel, inputs.get("rollout") or {}, outputs)
        if stage == "logprobs":
            want = self.committed_policy(k, mrel)
            if want is not None and inputs.get("policy_hash") != want:
                self.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
        if replayed:
            self.check_replay(mrel, stage, replayed, outputs, inputs)

    def check_part(self, rel: str, name: str, listed: dict, schema, stamp: str | None) -> None:
        if not self.store.exists(rel):
            self.audit.problem(rel, "missing (listed in MANIFEST.json)")
            return
        data = self.store.read_bytes(rel)
        self.audit.files += 1
        sha = hashlib.sha256(data).hexdigest()
        if sha != listed.get("sha256") or len(data) != listed.get("bytes"):
            self.audit.problem(rel, f"sha256 {short(sha)} ({len(data)} bytes) differs from MANIFEST.json's {short(listed.get('sha256'))} ({listed.get('bytes')} bytes)")
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
        if f.metadata.num_rows != listed.get("rows"):
            self.audit.problem(rel, f"{f.metadata.num_rows} rows, MANIFEST.json says {listed.get('rows')}")
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
        if ref.get("outputs_sha256") != canonical_hash(rm.get("outputs") or {}):
            self.audit.problem(mrel, f"inputs.rollout.outputs_sha256 does not match the outputs of {rd}")
        rows = {n: o.get("rows") for n, o in (rm.get("outputs") or {}).items()}
        mine = {n: o.get("rows") for n, o in outputs.items()}
        if rows != mine:
            self.audit.problem(mrel, f"its parts' rows {mine} differ from {rd}'s {rows}")

    def check_replay(self, mrel: str, stage: str, replayed: dict, outputs: dict, inputs: dict) -> None:
        link = {key: replayed.get(key) for key in ("run", "iteration", "manifest_sha256")}
        if inputs.get("replayed_from") != link:
            self.audit.problem(mrel, "replayed_from differs from inputs.replayed_from")
        src = RunStore(replayed.get("run", ""))
        src_dir = stage_rel(int(replayed.get("iteration", 0)), stage)
        try:
            src_sha = src.manifest_hash(src_dir)
        except Exception:  # the source may be gone or unreachable: this run is self-contained
            return
        if src_sha is None:
            return
        if src_sha != replayed.get("manifest_sha256"):
            self.audit.problem(mrel, f"replayed_from: {src.display(src_dir)}/{MANIFEST} has changed since the replay")
            return
        src_out = {n: o.get("sha256") for n, o in (src.manifest(src_dir).get("outputs") or {}).items()}
        if src_out != {n: o.get("sha256") for n, o in outputs.items()}:
            self.audit.problem(mrel, f"outputs are not the parts of {src.display(src_dir)}")

    # -- updates -------------------------------------------------------------------------
    def check_update(self, k: int) -> None:
        if (opened := self.open_stage(k, "update")) is None:
            return
        sd, m = opened
        mrel = f"{sd}/{MANIFEST}"
        self.check_fields(mrel, m, "update", k, UPDATE_METRICS.version)
        outputs = m.get("outputs") or {}
        listed = outputs.get("metrics.parquet")
        if listed is None:
            self.audit.problem(mrel, "lists no metrics.parquet")
        else:
            rel = f"{sd}/metrics.parquet"
            if not self.store.exists(rel):
                self.audit.problem(rel, "missing (listed in MANIFEST.json)")
            else:
                sha, n = self.sha_file(rel)
                self.audit.files += 1
                if sha != listed.get("sha256") or n != listed.get("bytes"):
                    self.audit.problem(rel, f"sha256 {short(sha)} differs from MANIFEST.json's {short(listed.get('sha256'))}")
        inputs = m.get("inputs") or {}
        for s in LINEAGE_STAGES:
            want = self.manifest_sha(stage_rel(k, s))
            if want is None:
                self.audit.problem(mrel, f"links to {stage_rel(k, s)}, which has no manifest")
            elif inputs.get(s) != want:
                self.audit.problem(mrel, f"inputs.{s} does not match {stage_rel(k, s)}/{MANIFEST}")
        want = self.committed_policy(k, mrel)
        if want is not None and inputs.get("policy_hash") != want:
            self.audit.problem(mrel, f"inputs.policy_hash does not match {policy_rel(k)}")
        out_policy = outputs.get("policy") or {}
        nxt = policy_rel(k + 1)
        pm = self.manifest(nxt) if self.store.exists(nxt) else None
        if pm is None:
            self.audit.problem(mrel, f"wrote {nxt}, which is missing or has no manifest")
        elif out_policy.get("path") != nxt or out_policy.get("policy_hash") != pm.get("policy_hash"):
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


# -- comparing two runs --------------------------------------------------------------------

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
            for name, o in sorted(((m or {}).get("outputs") or {}).items()):
                out.append((f"{stage_rel(k, stage)}/{name}", o.get("sha256")))
        m = run.manifest(k, "update")
        if m is not None:
            out.append((f"{stage_rel(k, 'update')}/metrics.parquet", (m.get("outputs") or {}).get("metrics.parquet", {}).get("sha256")))
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
