"""A run: its config, its policies and where each iteration stands.

`init_run` creates RUN/config.yaml and RUN/policy/iter-0000 (a copy of the initial model with
a MANIFEST.json of file hashes, so the run does not depend on the source directory staying
as it was). Everything else reads a run through `Run`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline import config as config_mod
from pipeline.config import Config
from pipeline.errors import GRPOError
from pipeline.run import gguf_import
from pipeline.run.policy import policy_kind
from pipeline.run.retention import is_pruned, pruned_error
from pipeline.run.template_date import with_template_date
from pipeline.run import inflight
from pipeline.store import (
    MANIFEST,
    STAGES,
    RunStore,
    canonical_hash,
    hash_dir,
    iter_name,
    policy_rel,
    stage_rel,
)
from schemas.manifests import Lineage, Manifest, PolicyManifest

CONFIG = "config.yaml"
RUN_MARK = "RUN.json"


def check_model_dir(path: str | Path, what: str = "model") -> Path:
    """A causal-LM Hugging Face directory with a tokenizer, else a one-line error."""
    p = Path(path)
    if not p.is_dir():
        raise GRPOError(f"{what} {path}: model directory not found")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise GRPOError(f"{what} {path}: no config.json (not a Hugging Face model directory)")
    try:
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
    except json.JSONDecodeError:
        raise GRPOError(f"{cfg_file}: not valid JSON") from None
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise GRPOError(f"{what} {path}: not a causal LM (architectures {archs or 'missing'})")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise GRPOError(f"{what} {path}: no tokenizer files")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise GRPOError(f"{what} {path}: no weights (*.safetensors)")
    return p


def policy_manifest(path: Path, iteration: int, source: str, lineage: Lineage | None = None,
                    hashed: dict[str, str] | None = None, **extra) -> PolicyManifest:
    """`extra`: e.g. `conversion` (a GGUF import) or `adapter` (a LoRA policy's base). `hashed`:
    {file: sha256} of files hashed as they were written (not read back here)."""
    files = hash_dir(path, skip=set(hashed or ()))
    files = dict(sorted({**files, **(hashed or {})}.items()))
    return PolicyManifest(stage="policy", iteration=iteration, source=source, files=files,
                          policy_hash=canonical_hash(files), lineage=lineage, **extra)


def with_hashed(pm: PolicyManifest, hashed: dict[str, str]) -> PolicyManifest:
    """`pm` with the files of `hashed` ({file: sha256}, hashed as they were written) listed too, and its hash anew."""
    files = dict(sorted({**pm.files, **hashed}.items()))
    return pm.model_copy(update={"files": files, "policy_hash": canonical_hash(files)})


def model_source(path: str, what: str = "model") -> tuple[Path, dict | None]:
    """A `model:` value as a local HF directory: a GGUF file is converted (once per machine,
    cached) and its conversion record returned; a directory is checked."""
    if gguf_import.is_gguf_path(path):
        folder, record = gguf_import.converted(path, what)
        return check_model_dir(folder, what), record
    return check_model_dir(path, what), None


@dataclass
class Run:
    uri: str

    waits = True
    """False on the `unwaited` view."""

    @cached_property
    def unwaited(self) -> Run:
        """This run for a reader that must never wait for this process's write in flight, nor meet its
        error (tracking, on its own thread: the error is the loop's to raise). An update whose record
        is in flight is not done to it yet (no manifest, its policy's hash unknown until on disk)."""
        view = copy.copy(self)
        view.waits = False
        return view

    @cached_property
    def store(self) -> RunStore:
        return RunStore(self.uri)

    @cached_property
    def cfg(self) -> Config:
        if not self.store.exists(CONFIG):
            raise GRPOError(f"{self.store.display()}: not a grpo run (no {CONFIG}); create it with `grpo init`")
        text = self.store.read_bytes(CONFIG).decode()
        return config_mod.from_yaml_text(text, source=self.store.display(CONFIG))

    @cached_property
    def code(self) -> dict | None:
        """The record of the reward, tool and environment code copied into the run at `grpo init`
        (pipeline/store/code.py); None for a config that names none, or a run made before it."""
        from pipeline.store import code

        return code.read(self.store)

    @cached_property
    def cfg_hash(self) -> str:
        """The config's hash, with the hash of its code where the run carries any; in the form its
        manifests were written with (`legacy_hash`)."""
        return self._hash(self.legacy_hash)

    def _hash(self, legacy: bool) -> str:
        from pipeline.store import code

        plain = config_mod.config_hash(self.cfg, legacy)
        return plain if self.code is None else canonical_hash({"config": plain, "code": code.code_hash(self.code)})

    @cached_property
    def legacy_hash(self) -> bool:
        """Whether the run's manifests carry the config hash of before `config.RECORD_ONLY` left it
        (train.state_every and the retention options hashed): its first stage manifest says. Such a
        run keeps that hash for good, so its record stays one hash; a run with no manifest yet takes today's."""
        old = self._hash(True)
        if old == self._hash(False):
            return False
        for k in self.iterations():
            for stage in STAGES:
                try:
                    m = self.store.manifest(stage_rel(k, stage))
                except GRPOError:  # unreadable: audit names it
                    continue
                if m is not None:
                    return getattr(m, "config_hash", None) == old
        return False

    # -- policies ------------------------------------------------------------------------
    def settle(self, k: int | None, what: str) -> str | None:
        """Wait for this process's write of policy k (None: whichever is in flight), if one is (pipeline/run/inflight.py):
        "hash" until update k-1's manifest names policy k's hash (returned), "files" until the
        policy's MANIFEST.json is written; its error raised. The one place a question about a
        policy or an update may wait."""
        return inflight.settle(self.store.root, k, what) if self.store.local and self.waits else None

    def writing(self, k: int):
        """Policy k's write while this process has it in flight (`inflight.Inflight`), else None. Never waits."""
        return inflight.get(self.store.root, k) if self.store.local else None

    def policy_done(self, k: int) -> bool:
        """Whether policy k is on disk (its MANIFEST.json, written last): settles its files."""
        self.settle(k, "files")
        return self.store.exists(f"{policy_rel(k)}/{MANIFEST}")

    def policy_hash(self, k: int) -> str:
        """Policy k's hash: settles only its hash where this process writes it (known before its files)."""
        if self.waits and self.writing(k) is not None:
            return self.settle(k, "hash")
        if not self.policy_done(k):
            if k > 0 and (self.done(k - 1, "update") or (self.store.local and inflight.held(self.store.root, k))):
                raise GRPOError(f"{self.store.display(policy_rel(k))}: {self.unwritten(k)}")
            raise GRPOError(f"{self.store.display(policy_rel(k))}: policy missing (run `grpo update` for iteration {k - 1} first)")
        return self.store.manifest(policy_rel(k)).policy_hash

    def unwritten(self, k: int) -> str:
        """Why policy k has no MANIFEST.json though update k-1 is done: another process is writing it
        in the background now, or a kill stopped that write (and what re-creates it)."""
        if self.store.local and inflight.held(self.store.root, k):
            return "policy not written yet: another grpo process (its `grpo iterate`) is writing it in the background; wait for it"
        return (f"policy missing, its write was interrupted (update {k - 1} is done); `grpo update {self.uri} --iter {k - 1}` "
                f"or `grpo iterate` re-creates it")

    def policy_pruned(self, k: int) -> bool:
        """Whether policy k's weights were removed by `train.keep_policies` (its manifest stays)."""
        return is_pruned(self, k)

    def policy_dir(self, k: int, needed_by: str = "this stage", weights: bool = True) -> Path:
        """Local directory of policy k (downloaded to the cache for remote runs). `weights` False:
        only its tokenizer and config are read, which are there before the weights file of a write
        in flight; otherwise its files are settled (`policy_done`)."""
        if not weights and self.writing(k) is not None:
            return self.store.local_dir(policy_rel(k))
        self.policy_done(k)
        self.policy_hash(k)
        if self.policy_pruned(k):
            raise pruned_error(self, k, needed_by)
        return self.store.local_dir(policy_rel(k))

    @cached_property
    def policy(self):
        """The run's kind of policy (whole weights, or LoRA adapters on policy 0), held once
        (pipeline/run/policy.py)."""
        return policy_kind(self.cfg)

    def plain_dir(self, k: int) -> Path:
        """Policy k's tokenizer and config: its own directory, or a LoRA adapter's base."""
        return self.policy.plain_dir(self, k)

    def ref_dir(self) -> Path:
        if self.cfg.ref_model is None:
            return self.policy_dir(0)
        return model_source(self.cfg.ref_model, "ref_model")[0]

    # -- stages --------------------------------------------------------------------------
    def done(self, k: int, stage: str) -> bool:
        """Whether iteration k's `stage` is done; an update whose record is in flight settles its hash."""
        return (rel := self._settled(k, stage)) is not None and self.store.exists(f"{rel}/{MANIFEST}")

    def manifest(self, k: int, stage: str) -> Manifest | None:
        return None if (rel := self._settled(k, stage)) is None else self.store.manifest(rel)

    def _settled(self, k: int, stage: str) -> str | None:
        """The stage's directory, once an update whose record is in flight has its manifest written
        (`unwaited`: None while it is in flight)."""
        if stage == "update":
            if not self.waits and self.writing(k + 1) is not None:
                return None
            self.settle(k + 1, "hash")
        return stage_rel(k, stage)

    def completed_iters(self) -> int:
        """Iterations whose update is done (= index of the newest policy); one whose record is in
        flight counts. Never waits."""
        k = 0
        while self.writing(k + 1) is not None or self.store.exists(f"{stage_rel(k, 'update')}/{MANIFEST}"):
            k += 1
        return k

    def next_iter(self, stage: str) -> int:
        """The first iteration whose `stage` is not done."""
        k = 0
        while self.done(k, stage):
            k += 1
        return k

    def require(self, k: int, stage: str, needs: str) -> Manifest:
        """The manifest of a stage another one depends on, or a one-line ordering error."""
        m = self.manifest(k, needs)
        if m is None:
            raise GRPOError(f"{stage} iteration {k}: {needs} of iteration {k} is not done (run `grpo {needs} {self.uri} --iter {k}` first)")
        return m

    def iterations(self) -> list[int]:
        ks = [int(n[5:]) for n in self.store.listdir("") if n.startswith("iter-") and n[5:].isdigit()]
        return sorted(ks)


def init_run(uri: str, cfg: Config, merged_from: dict | None = None, code_from: Run | None = None) -> Run:
    """Create a run; an existing run with the same config is reused, a different one refused.
    `merged_from`: policy 0 is a LoRA adapter merged into its base (a replay); recorded in its manifest.
    `code_from`: a run whose copies of the reward code are taken for the targets it has (a replay)."""
    from pipeline.store import code

    store = RunStore(uri)
    old = None
    if store.exists(CONFIG):
        old = config_mod.from_yaml_text(store.read_bytes(CONFIG).decode(), source=store.display(CONFIG))
    elif store.exists("") and store.listdir(""):
        raise GRPOError(f"{store.display()}: directory exists and is not empty; choose a new run directory")
    model, conversion = model_source(cfg.model, "model")
    cfg = with_template_date(cfg, model, old)  # the day a template's date reads: recorded once, kept by a re-init
    if old is not None:
        legacy = Run(uri).legacy_hash  # such a run's hash holds train.state_every: changing it is another run there
        if config_mod.config_hash(old, legacy) != config_mod.config_hash(cfg, legacy):
            raise GRPOError(f"{store.display(CONFIG)}: a run with a different config already exists; choose a new run directory")
    new_yaml = config_mod.to_yaml(cfg)
    ref = model_source(cfg.ref_model, "ref_model")[0] if cfg.ref_model else None
    policy_kind(cfg).check_model(model)  # the run does not exist yet to hold its policy
    if cfg.train.packing == "on":  # refused here, not at the logprobs stage's first forward
        from pipeline.models.packing import check_dir  # lazy: it imports torch, which `grpo init` otherwise never loads

        for what, d in (("model", model), ("ref_model", ref)):
            if d is not None:
                check_dir(d, what)
    prior = code.local_copies(code_from.store, code_from.code) if code_from is not None and code_from.code else None
    collected = None if store.exists(CONFIG) else code.collect(cfg, prior)  # refused here (a local package) before anything is written
    run = Run(uri)
    if not run.policy_done(0):
        store.put_dir(model, policy_rel(0))
        local = store.local_dir(policy_rel(0)) if store.local else model
        source = conversion["gguf_file"] if conversion else str(model.resolve())
        store.write_manifest(policy_rel(0), policy_manifest(local, 0, source=source, conversion=conversion, merged_from=merged_from))
    if collected is not None:
        code.pack(store, *collected)  # the reward code, copied and recorded before the config
        store.write_bytes(CONFIG, new_yaml.encode())  # last: a run exists once its config does
    elif run.code is not None:
        if code.code_hash(code.collect(cfg)[0]) != code.code_hash(run.code):
            raise GRPOError(f"{store.display(code.RECORD)}: the run's reward, tool or environment code differs from "
                            f"what the config names now; choose a new run directory")
    if old is not None and (config_mod.record_only(old) != config_mod.record_only(cfg) or old.url_secret_params != cfg.url_secret_params):
        # the same run keeping another record from now on (train.state_every, retention), or redacting another URL
        # parameter (url_secret_params: the later stages read only its config): its config says so
        kept = old.model_copy(update={"url_secret_params": cfg.url_secret_params})
        for section, key in config_mod.RECORD_ONLY:
            kept = kept.model_copy(update={section: getattr(kept, section).model_copy(update={key: getattr(getattr(cfg, section), key)})})
        store.write_bytes(CONFIG, config_mod.to_yaml(kept).encode())
        run = Run(uri)
    return run


def status_rows(run: Run) -> list[dict]:
    """One row per iteration: which stages are done, rows and seconds of each."""
    rows = []
    last = max(run.iterations() + [run.completed_iters()])
    for k in range(last + 1):
        row = {"iteration": k, "policy": run.policy_done(k)}
        for stage in STAGES:
            m = run.manifest(k, stage)
            row[stage] = m
        rows.append(row)
    return rows


__all__ = ["Run", "init_run", "check_model_dir", "status_rows", "iter_name", "stage_rel", "policy_rel"]
