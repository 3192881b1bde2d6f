"""MANIFEST.json of every stage and policy, declared once and versioned.

A manifest is the only proof that a stage happened (see `pipeline.store`). Every writer builds
one of these models and every reader gets one back, validated: an unreadable, old-version or
malformed manifest is a one-line `ManifestError` naming the file and the field.

    PartsManifest   iter-K/{rollout,score,logprobs,eval}/MANIFEST.json
    UpdateManifest  iter-K/update/MANIFEST.json
    PolicyManifest  policy/iter-K/MANIFEST.json
    StateManifest   iter-K/update/state/MANIFEST.json (a trainer state written after update K's manifest)

MANIFEST_VERSION is raised whenever a field changes meaning or a required one is added; a
reader refuses other versions rather than guessing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MANIFEST_VERSION = 1


class ManifestError(ValueError):
    """A manifest that cannot be read as this grpo writes them (the message names the file)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileEntry(_Model):
    """One output file: its sha256, size and (for Parquet) row count."""

    sha256: str
    bytes: int = Field(ge=0)
    rows: int | None = Field(None, ge=0)


class _Manifest(_Model):
    manifest_version: Literal[1] = MANIFEST_VERSION
    """The version of this layout (see the module docstring)."""
    iteration: int = Field(ge=0)
    created: str | None = None
    """UTC time the manifest was written (set by the run store)."""
    code_version: str | None = None
    """grpo's version and commit that wrote it (set by the run store)."""


class ReplayLink(_Model):
    """Where a replayed stage's parts came from (`grpo replay`)."""

    run: str
    iteration: int = Field(ge=0)
    manifest_sha256: str
    input_hash: str
    """The stamp the copied parts carry (the source stage's input_hash)."""


class PartsManifest(_Manifest):
    """A stage written as Parquet parts: rollout, score, logprobs, eval."""

    stage: Literal["rollout", "score", "logprobs", "eval"]
    schema_version: int
    """Version of the parts' Parquet schema (`schemas.artifacts`)."""
    config_hash: str
    seed: int
    input_hash: str
    """Hash of the config, stage, iteration and inputs; stamped into every part."""
    inputs: dict[str, Any]
    """What the stage read: the policy (rollout, eval, logprobs) or the upstream stages' manifests."""
    outputs: dict[str, FileEntry]
    rows: int = Field(ge=0)
    timings: dict[str, float]
    policy_hash: str | None = None
    """rollout, eval: the policy the completions were sampled from."""
    staleness: int | None = Field(None, ge=0)
    """rollout with train.max_staleness > 0: k - b(k), the updates between the behaviour policy
    that sampled (inputs.policy) and policy k that the update trains (pipeline/schedule.py)."""
    engine: str | None = None
    """rollout: the generation engine."""
    engine_dtype: str | None = None
    """rollout: the engine's dtype as resolved on this machine (`rollout.dtype` auto follows train.precision)."""
    stats: dict[str, float] | None = None
    """rollout, logprobs, eval: where the stage's time went (seconds, tokens)."""
    metrics: dict[str, dict[str, float]] | None = None
    """eval: every figure (pipeline/eval/metrics.py) as {value, lo, hi}, its 95 % interval."""
    figures_version: int | None = None
    """eval: how the figures were computed (pipeline/eval/metrics.py FIGURES_VERSION); None: before it was recorded."""
    observed: dict[str, Any] | None = None
    """eval: the range each reward figure without a declared range took over the run's scored samples when it ran
    (pipeline/eval/observed.py: `iterations`, `samples`, `ranges` {figure: [lo, hi]}), which its interval's span joins."""
    no_interval: dict[str, str] | None = None
    """eval: the figures whose interval is NaN and why, in a few words (pipeline/eval/metrics.py no_interval)."""
    rewards: list[dict[str, Any]] | None = None
    """score (and eval with a served reward): the reward functions as configured."""
    trainer_state: dict[str, Any] | None = None
    """rollout, score: the TRL `trainer_state` the reward functions saw (global_step, epoch, ...)."""
    passes: dict[str, Any] | None = None
    """logprobs: which policy each logprob column came from, and how many forward passes were made."""
    reward_metrics: dict[str, float] | None = None
    """score: the iteration's mean of each value reward functions passed to `log_metric`."""
    replayed_from: ReplayLink | None = None
    workers: dict[str, Any] | None = None
    """rollout, score under the Ray executor: `parts` (each part this command wrote -> the worker,
    "node/pid", that wrote it), `seconds` (each worker's seconds on them) and `straggler` (the slowest
    part: part, worker, seconds). A resumed stage records only the parts its last command wrote."""
    judge: dict[str, dict[str, Any]] | None = None
    """score and eval with a served reward (`judge`, a served `reward_model`): per reward, requests, calls made,
    answers reused, retries, failures, unreadable answers (and their reasons), latency and tokens, summed over the parts."""


class UpdateInputs(_Model):
    rollout: str
    score: str
    logprobs: str
    """sha256 of the three stages' manifests the update trained on."""
    policy_hash: str
    """The policy it started from."""
    state: str | None = None
    """Hash of the trainer state it resumed (None at iteration 0)."""


class PolicyRef(_Model):
    path: str
    policy_hash: str


class UpdateOutputs(_Model):
    metrics: FileEntry = Field(alias="metrics.parquet")
    policy: PolicyRef
    old_logprobs: FileEntry | None = Field(None, alias="old_logprobs.parquet")
    """The old logprobs the update took from its own forward (`train.old_logprobs`); absent when
    the logprobs stage computed them."""
    state: str | None = None
    """Hash of the trainer state it wrote (iter-K/update/state): the next update's `inputs.state`."""


class UpdateManifest(_Manifest):
    """The policy update of iteration K: its metrics and the policy K+1 it wrote."""

    stage: Literal["update"]
    schema_version: int
    config_hash: str
    seed: int
    inputs: UpdateInputs
    outputs: UpdateOutputs
    policy_hash: str
    """The policy written (K+1)."""
    rows: int = Field(ge=0)
    optimizer_steps: int = Field(ge=0)
    global_step: int = Field(ge=0)
    kl_coef: float
    world_size: int = Field(ge=1)
    precision: str | None = None
    """fp32, or bf16 autocast for the decoder (train.precision as resolved on this machine)."""
    state_every: int | None = None
    """train.state_every when it was written: `outputs.state` is None where no state was due. None:
    an update written before states became periodic (it wrote one every time)."""
    timings: dict[str, float]


class Lineage(_Model):
    """How a policy K > 0 came to be: the update of K-1, its inputs, the policy it started from."""

    update_iteration: int = Field(ge=0)
    inputs: dict[str, str]
    from_policy_hash: str


class AdapterBase(_Model):
    """The base model a LoRA adapter applies to: policy 0 of the run, named by its hash."""

    base: str
    base_policy_hash: str


class MergedFrom(_Model):
    """Policy 0 of a replay of a LoRA run's iteration K >= 1: SRC's adapter K merged into SRC's base."""

    run: str
    iteration: int = Field(ge=1)
    adapter_policy_hash: str
    """SRC's policy K (the adapter): the policy the replayed completions were sampled from."""
    base_policy_hash: str


class PolicyManifest(_Manifest):
    """A policy directory: every file's sha256; the policy hash is the hash of that list."""

    stage: Literal["policy"]
    source: str
    files: dict[str, str]
    policy_hash: str
    lineage: Lineage | None = None
    conversion: dict[str, Any] | None = None
    """Policy 0 converted from a .gguf: the file's sha256, dtype, architecture, library versions."""
    adapter: AdapterBase | None = None
    """A LoRA policy (K >= 1): only the adapter is stored; this names its base."""
    merged_from: MergedFrom | None = None
    """Policy 0 of a replayed LoRA iteration: these weights are that adapter merged into its base."""


class StateManifest(_Manifest):
    """The trainer state a command writes at its end (or on Ctrl-C) after update K's manifest, which
    therefore cannot name its hash as it names that of a state written with it (`outputs.state`)."""

    stage: Literal["state"]
    state_hash: str
    """The canonical hash of every file of the state (`pipeline.store.hash_dir`), as `outputs.state`."""


Manifest = Annotated[Union[PartsManifest, UpdateManifest, PolicyManifest, StateManifest], Field(discriminator="stage")]
_ADAPTER: TypeAdapter = TypeAdapter(Manifest)


def parse_manifest(raw: bytes, where: str) -> PartsManifest | UpdateManifest | PolicyManifest | StateManifest:
    """A manifest's bytes, validated; ManifestError naming `where` and the field otherwise."""
    try:
        obj = json.loads(raw)
    except ValueError:
        raise ManifestError(f"{where}: not valid JSON") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: not a JSON object")
    version = obj.get("manifest_version")
    if version != MANIFEST_VERSION:
        found = "no manifest_version (written by a grpo before manifests were versioned)" if version is None else f"manifest version {version!r}"
        raise ManifestError(f"{where}: {found}; this grpo reads version {MANIFEST_VERSION}")
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as err:
        first = err.errors()[0]
        path = first["loc"][1:] if first["loc"][:1] == (obj.get("stage"),) else first["loc"]  # drop the union's tag
        loc = ".".join(str(p) for p in path) or "(top level)"
        msg = "unknown key" if first["type"] == "extra_forbidden" else "required key is missing" if first["type"] == "missing" else first["msg"]
        raise ManifestError(f"{where}: {loc}: {msg}") from None


def dump_manifest(m: BaseModel) -> bytes:
    """The bytes a manifest is written as (sorted keys, so equal content gives equal bytes)."""
    return (json.dumps(m.model_dump(mode="json", by_alias=True, exclude_none=True), indent=2, sort_keys=True) + "\n").encode()
