"""The record `grpo audit` fills (`Audit`) and the auditor's shared state and helpers (`Auditor`):
reading a manifest as a problem rather than a crash, the common manifest fields, file hashes,
committed policies. The checks themselves: `pipeline.report.audit_lineage` (policies, updates)
and `pipeline.report.audit_parts` (part stages); the walk over a run: `pipeline.report.audit`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from pipeline.errors import GRPOError
from pipeline.store import MANIFEST, TMP_MARK, hash_dir, policy_rel, stage_rel
from pipeline.run.run import Run

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
    weightless: list[str] = field(default_factory=list)
    """Policies audited without their weight files (`grpo audit --without-weights`: a record copied without them)."""
    unchecked_episodes: int = 0
    """Episode rows whose ids were not re-derived (audit_episodes.py): written before their record kept what
    was inserted (episode version 1), or no policy directory holds the tokenizer any more."""
    eval_episodes: int = 0
    """Held-out episode rows (an eval part's): hash-checked and in the recomputed figures, their ids not
    re-derived (an eval part keeps no ids); counted so the summary says so, not skipped silently."""

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
        if self.weightless:
            skipped = f"; {len(self.weightless)} policies' weight files absent and not checked (--without-weights)" + skipped
        if self.unchecked_episodes:
            skipped += (f"; {self.unchecked_episodes} episode row(s) whose ids were not re-derived (recorded before grpo "
                        "kept what an episode inserted, or no tokenizer left)")
        if self.eval_episodes:
            skipped += f"; {self.eval_episodes} held-out episode row(s) whose ids were not re-derived (an eval part keeps no ids)"
        if self.ok:
            return (f"audit {self.uri}: ok, {self.iterations} iteration(s), {self.manifests} manifests and "
                    f"{self.files} files verified, lineage intact{skipped}")
        return f"audit {self.uri}: {len(self.problems)} problem(s){skipped}"


class Auditor:
    """One audit's state: the run, the `Audit` it fills, the committed policies' hashes seen so far."""

    def __init__(self, run: Run, weights: bool = True):
        self.run, self.store = run, run.store
        self.weights = weights  # False: a policy's listed files may be absent (a record copied without weights)
        self.cfg_hash = run.cfg_hash  # an unreadable or invalid config.yaml is a GRPOError here
        self.audit = Audit(run.store.display())
        self.policy: dict[int, str] = {}  # committed policies' recorded hashes
        self.config_mismatch: list[str] = []
        self._tokens: object = False  # the run's tokenizer for episode rows (episode_tokens), once looked up
        self._inputs: dict = {}  # iteration -> its rollout inputs, for endpoint episode rows (endpoint_inputs)

    def manifest(self, rel_dir: str):
        """The typed manifest, or None: absent, or unreadable / malformed (recorded as a problem)."""
        try:
            return self.store.manifest(rel_dir)
        except GRPOError as err:
            self.audit.problem(f"{rel_dir}/{MANIFEST}", str(err).removeprefix(f"{self.store.display(f'{rel_dir}/{MANIFEST}')}: "))
            return None

    def endpoint_inputs(self, k: int):
        """(iteration k's RolloutInputs, whether its seeds are this run's) for auditing endpoint episodes:
        the rollout's own template, tool format and budget; a replayed rollout's seeds are its source's."""
        if k not in self._inputs:
            from pipeline.rollout import RolloutInputs

            m = self.store.manifest(stage_rel(k, "rollout"))
            self._inputs[k] = (RolloutInputs(self.run, k), m.replayed_from is None)
        return self._inputs[k]

    def episode_tokens(self):
        """The run's tokenizer as episodes tokenise (pipeline/agents/inserted.py's Tokens), from the first
        committed policy whose directory still holds it; None when none does (pruned, or not local)."""
        if self._tokens is False:
            from pipeline.agents.inserted import Tokens
            from pipeline.models.tokenizer_cache import tokenizer_of

            self._tokens = None
            for k in sorted(self.policy):
                try:
                    folder = self.run.plain_dir(k)
                except (GRPOError, OSError):
                    continue
                if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                    self._tokens = Tokens(tokenizer_of(folder))
                    break
        return self._tokens

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
