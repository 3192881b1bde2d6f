"""The run's configuration: one pydantic model tree, loaded from YAML, overridden by `--set`.

Precedence: field defaults < the YAML file < `--set dotted.key=value` overrides. The tree is
validated once; the resolved config is written into the run as `config.yaml` and its sha256
(over a canonical JSON form) names the run's settings in every manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from pipeline.config.advantages import AdvantageConfig
from pipeline.config.agents import AGENT_NEUTRAL
from pipeline.config.base import Section
from pipeline.config.cluster import ClusterConfig
from pipeline.config.data import DataConfig
from pipeline.config.errors import format_error, parse_overrides, read_tree, set_dotted
from pipeline.config.eval import EVAL_NEUTRAL, EvalConfig, SetRef, eval_sets
from pipeline.config.loss import NEUTRAL_ROLLOUT_CORRECTION, LossConfig
from pipeline.config.rewards import RewardSpec
from pipeline.config.rollout import RolloutConfig
from pipeline.config.rules import refusal
from pipeline.config.urls import checked, name_secret_params
from pipeline.config.train import TrainConfig
from pipeline.errors import GRPOError


class TrackingConfig(Section):
    """MLflow tracking."""

    mlflow: bool = True
    """Log to MLflow."""
    mlflow_uri: str | None = None
    """Tracking URI; None uses MLFLOW_TRACKING_URI or else a store inside the run directory. No user:password or token in it (MLflow reads MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN)."""

    @field_validator("mlflow_uri")
    @classmethod
    def _no_secret_written(cls, value: str | None, info: ValidationInfo) -> str | None:
        fix = "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
        return value if value is None else checked(value, info.context, fix)
    experiment: str = "grpo"
    """MLflow experiment name."""
    sample_completions: int = Field(16, ge=0)
    """Completions logged per iteration as an MLflow table."""
    plots_every: int = Field(10, ge=0)
    """Redraw the PNG plots and diagnostics.json every N iterations (0: only when `grpo iterate`
    ends); drawing them reads the whole history, so it is not done per stage."""


class Config(Section):
    """A grpo run's settings."""

    model: str
    """The initial policy: a Hugging Face model directory (causal LM + tokenizer)."""
    ref_model: str | None = None
    """Reference model for the KL term; None = the initial `model`."""
    data: DataConfig
    """Prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """Stage 1: sampling."""
    rewards: list[RewardSpec] = []
    """Stage 2: reward functions (at least one, unless a rollout.environment class defines
    get_reward: `grpo init` then adds it, as TRL does, see pipeline/agents/environment.py)."""
    advantages: AdvantageConfig = AdvantageConfig()
    """Stage 2: advantages."""
    loss: LossConfig = LossConfig()
    """Stage 4: loss."""
    train: TrainConfig = TrainConfig()
    """Stage 4: optimisation."""
    eval: EvalConfig = EvalConfig()
    """Periodic evaluation."""
    seed: int = Field(0, ge=0)
    """The one seed: prompt order, sampling and update shuffles derive from it."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow."""
    cluster: ClusterConfig = ClusterConfig()
    """Where `grpo iterate` runs the stages (this process, or a Ray cluster); not part of the config hash."""
    url_secret_params: list[str] = []
    """Names of URL parameters that hold a secret, beyond those whose name says so (key, token, sig, code, ...:
    pipeline/config/urls.py), e.g. `[k, sid]`: a literal value under one, in any URL option, is refused (write
    `k=${NAME}`), and a URL taken from the environment shows it as `***`. Not part of the config hash."""

    @model_validator(mode="before")
    @classmethod
    def _secret_names_first(cls, data, info: ValidationInfo):
        """`url_secret_params` reaches every URL option's check, which runs before this model's own fields."""
        if isinstance(data, dict) and isinstance(info.context, dict) and isinstance(data.get("url_secret_params"), list):
            info.context["secret_params"] = [n for n in data["url_secret_params"] if isinstance(n, str)]
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        if (why := refusal(self)) is not None:
            raise ValueError(why)
        name_secret_params(self.url_secret_params)
        return self

    @property
    def ref_model_path(self) -> str:
        return self.ref_model or self.model

    @property
    def weight_sync(self) -> str:
        """rollout.weight_sync resolved: auto is memory for full fine-tuning, disk with train.lora."""
        if self.rollout.weight_sync == "auto":
            return "disk" if self.train.lora is not None else "memory"
        return self.rollout.weight_sync

    @property
    def dropout(self) -> bool:
        """Whether the trained forward has dropout (a LoRA adapter's), so two forwards of one batch differ."""
        return self.train.lora is not None and self.train.lora.dropout > 0

    def eval_sets(self) -> list[SetRef]:
        """data.eval as the sets the eval runs (pipeline/config/eval.py)."""
        return eval_sets(self.data.eval, self.eval)


def resolve(tree: dict, sets: list[str] | None = None, source: str = "config", sources: dict[str, str] | None = None,
            stored: bool = False) -> Config:
    """Validate a raw config tree with overrides applied; one-line GRPOError on failure, from
    `source` (or the `sources` entry of the key at fault, see `format_error`). `stored`: a run's own
    config.yaml, read as it was written (a URL's literal secret from before pipeline/config/urls.py is
    not refused there)."""
    tree = json.loads(json.dumps(tree))  # deep copy, plain types only
    for key, raw in parse_overrides(sets):
        set_dotted(tree, key, raw)
    try:
        return Config.model_validate(tree, context={"stored": stored})
    except ValidationError as err:
        raise GRPOError(format_error(err, source, Config, sources=sources)) from None


def load(path: str | Path, sets: list[str] | None = None) -> Config:
    """Load a YAML config file, apply `--set` overrides, validate once."""
    return resolve(read_tree(path), sets, source=str(path))


ADDED_OPTIONS: dict[tuple[str, ...], object] = {
    ("train", "gradient_checkpointing"): False,
    ("train", "packing"): "off",  # right-padded batches, as before
    ("loss", "rollout_correction"): NEUTRAL_ROLLOUT_CORRECTION,
    **AGENT_NEUTRAL,
    ("train", "max_staleness"): 0,
    ("train", "state_every"): 1,  # the trainer state after every update, as every update wrote it
    ("rollout", "enforce_eager"): None,  # eager on the CPU, as before; on a GPU, CUDA graphs
    ("rollout", "weight_sync"): "disk",
    ("train", "cpu_attention"): "sdpa",  # torch's SDPA kernel choice in every update piece, as before
    ("rollout", "hf_sampler"): None,  # per group on a CPU, Gumbel-max in one batch on a GPU, as before
    ("data", "template_date"): None,  # a template that reads no date: nothing pinned
    **EVAL_NEUTRAL,
    ("cluster",): ClusterConfig().model_dump(mode="json"),  # where the stages run: out of the hash at any value (canonical)
    ("url_secret_params",): [],  # what a URL may not hold as written: out of the hash at any value (canonical)
}
"""Options added after runs already existed, with the value that does what runs did before them:
left out of the canonical form at that value, so the config hash of a run made before the option
(its config.yaml lacks it) stays the one its manifests were written with; and a stored config.yaml
that lacks one is read with that value (`from_yaml_text`), even where a new run's default differs."""

ADDED_REWARD_OPTIONS: dict[str, object] = {"range": None}
"""`ADDED_OPTIONS` of every `rewards:` entry (a list, which ADDED_OPTIONS' paths do not reach): the
option's value that does what runs did before it, left out of the canonical form there."""


RECORD_ONLY: tuple[tuple[str, str], ...] = (("train", "state_every"), ("train", "keep_states"), ("train", "keep_policies"))
"""Options that change only what the record keeps (how often a trainer state is written, how many
states and policies' weights stay), never the bytes a run computes: out of the config hash at any
value, so changing one (`grpo init` again) is not another run. Runs whose manifests were written
while they were hashed keep that hash (`legacy`; pipeline.run.run.Run.cfg_hash tells them apart)."""


def canonical(cfg: Config, legacy: bool = False) -> str:
    """Canonical JSON of the resolved config: sorted keys, defaults filled in (but for
    `ADDED_OPTIONS` at their earlier behaviour), `RECORD_ONLY` left out (`legacy`: kept, as runs
    made before that hashed them)."""
    tree = cfg.model_dump(mode="json")
    tree.pop("cluster", None)  # where the stages run, not what they compute: a Ray run writes a local run's bytes
    tree.pop("url_secret_params", None)  # which URL parameters are secrets: refused or redacted, never computed with
    for section, key in RECORD_ONLY if not legacy else ():
        tree[section].pop(key, None)
    for (*path, key), neutral in ADDED_OPTIONS.items():
        section = tree
        for part in path:
            section = section.get(part) or {}
        if key in section and section[key] == neutral:
            del section[key]
    if tree["rollout"].get("engine") != "hf":  # vLLM samples with its own sampler: the HF engine's computes nothing
        tree["rollout"].pop("hf_sampler", None)
    if tree["rollout"].get("weight_sync") == "auto":  # never the bytes: the hash of disk's (memory, as runs made with it hashed it, keeps its own)
        del tree["rollout"]["weight_sync"]
    for entry in tree.get("rewards") or []:
        for key, neutral in ADDED_REWARD_OPTIONS.items():
            if key in entry and entry[key] == neutral:
                del entry[key]
    return json.dumps(tree, sort_keys=True, separators=(",", ":"))


def config_hash(cfg: Config, legacy: bool = False) -> str:
    return hashlib.sha256(canonical(cfg, legacy).encode()).hexdigest()


def record_only(cfg: Config) -> dict:
    """The `RECORD_ONLY` options' values."""
    return {f"{section}.{key}": getattr(getattr(cfg, section), key) for section, key in RECORD_ONLY}


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def from_yaml_text(text: str, source: str) -> Config:
    """A run's stored config.yaml: an option it lacks was added after the run was made, and gets
    the value that keeps the run's behaviour (`ADDED_OPTIONS`), not a new run's default."""
    tree = yaml.safe_load(text) or {}
    for (*path, key), neutral in ADDED_OPTIONS.items():
        section = tree
        for part in path:
            section = section.setdefault(part, {}) if isinstance(section, dict) else None
        if isinstance(section, dict) and key not in section:
            section[key] = json.loads(json.dumps(neutral))
    return resolve(tree, None, source=source, stored=True)
