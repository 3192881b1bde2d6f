"""The run's configuration: one pydantic model tree, loaded from YAML, overridden by `--set`.

Precedence: field defaults < the YAML file < `--set dotted.key=value` overrides. The tree is
validated once; the resolved config is written into the run as `config.yaml` and its sha256
(over a canonical JSON form) names the run's settings in every manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.config_errors import format_error, parse_overrides, read_tree, set_dotted
from pipeline.errors import GRPOError
from pipeline.loss_config import NEUTRAL_ROLLOUT_CORRECTION, LossConfig
from pipeline.rewards.config import RewardSpec
from pipeline.agents.options import AGENT_NEUTRAL
from pipeline.cluster.config import ClusterConfig
from pipeline.eval.config import EVAL_NEUTRAL, EvalConfig, EvalSet, SetRef, eval_sets, refusal as eval_refusal
from pipeline.rollout_config import RolloutConfig, Section as _Section
from pipeline.staleness import uncorrectable


class DataConfig(_Section):
    """Where prompts come from and how they are rendered."""

    train: str
    """Training prompts: a .jsonl, .json or .parquet file, a directory or glob of Parquet shards (Hub layout), or a `datasets` save_to_disk directory (local path or fsspec URI)."""
    eval: str | dict[str, str | EvalSet] | None = None
    """Held-out prompts for periodic evaluation (same forms as train), or a mapping of set names to
    files ({path, reward} for a set with its own accuracy reward), each reported under its name; None disables eval."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content})."""
    prompt_template: str | None = None
    """Builds the prompt column from other columns where a row has none, e.g. "{question}" (Python str.format fields)."""
    system_prompt: str | None = None
    """System message prepended to every prompt when the chat template is applied."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds plain text prompts as they are."""


class KLRewardConfig(_Section):
    """KL placed in the reward (toxicity-workflow style) instead of the loss."""

    coef: float = Field(0.0, ge=0.0)
    """Initial KL coefficient subtracted from each completion's reward (sum over tokens of k1)."""
    target: float | None = Field(None, gt=0.0)
    """Adaptive controller target KL per completion; None keeps coef fixed."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon (Ziegler et al.), in completions."""


class AdvantageConfig(_Section):
    """Group-relative normalisation of rewards into advantages (stage 2)."""

    scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group's std, the whole batch's std, or not at all (Dr. GRPO)."""
    std: Literal["sample", "population"] = "sample"
    """Std convention: sample (Bessel, torch.std and TRL) or population."""
    eps: float = Field(1e-4, ge=0.0)
    """Added to the std before dividing."""
    std_floor: float | None = Field(None, gt=0.0)
    """Clamp the std below at this floor instead of adding eps (seed notes: 0.1)."""
    batch_renorm: bool = False
    """Re-normalise the advantages over the whole batch after the group step."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards have no spread from training (recorded in the score part, not deleted)."""
    kl_in_reward: KLRewardConfig = KLRewardConfig()
    """Optional KL penalty folded into the reward before normalisation (applied at update time)."""

    def of(self, rewards, num_generations: int):
        """The advantages of total rewards [N] (a NumPy array, groups of `num_generations`) under these settings."""
        from pipeline.advantages import group_advantages

        return group_advantages(rewards, num_generations, scale=self.scale, std=self.std, eps=self.eps,
                                std_floor=self.std_floor, batch_renorm=self.batch_renorm)


ALL_LINEAR = "all-linear"


class LoraSpec(_Section):
    """LoRA adapters (PEFT): train low-rank updates of the base's projections, not every weight."""

    r: int = Field(16, ge=1, le=1024)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0.0)
    """Scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during the update (not when computing logprobs)."""
    target_modules: list[str] | Literal["all-linear"] = ALL_LINEAR
    """Module names (suffixes, as PEFT matches them) to adapt; all-linear = every linear projection
    except the LM head. A name that matches no module of the model is an error at `grpo init`."""


class KeepPoliciesConfig(_Section):
    """Policy retention: which stored policies keep their weights (see pipeline/store/retention.py)."""

    last: int | None = Field(None, ge=1)
    """Keep the weights of the newest `last` policies; None (the default) keeps every policy.
    Older ones are pruned after each update: their MANIFEST.json (file hashes) stays, so audit
    still checks the lineage; policy/iter-0000 is always kept."""
    every: int = Field(0, ge=0)
    """Also keep every N-th policy (iter-K with K % N == 0), as milestones; 0 keeps none
    beyond `last` and iter-0000. Only read when `last` is set."""


class TrainConfig(_Section):
    """The policy update (stage 4)."""

    epochs: int = Field(1, ge=1)
    """Passes over each iteration's completions (TRL's num_iterations)."""
    mini_batch_size: int = Field(32, ge=1)
    """Completions per optimizer step (before grad_accum)."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step; mini_batch_size must be divisible by it."""
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule over total_iters iterations after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer steps."""
    total_iters: int = Field(100, ge=1)
    """Horizon for linear/cosine decay, in iterations."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    bf16: bool = False
    """Keep the trained weights in bf16 under DeepSpeed (fp32 master copy in the optimizer);
    independent of `precision`, which only sets the arithmetic of the forward/backward."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Arithmetic of the model's forward/backward in the logprobs stage and the update: bf16
    autocast (weights stay fp32; the LM head, logprobs and loss stay fp32) or plain fp32. auto =
    bf16 where the CPU has bf16 instructions (AVX512-bf16 or AMX) or the GPU supports it, else
    fp32; the manifests record what was used."""
    token_budget: int = Field(8192, ge=64)
    """Tokens per forward pass when computing logprobs (batches are cut by this budget)."""
    update_token_budget: int = Field(1024, ge=64)
    """Tokens (real ones when packed, else padded) per forward/backward piece of the update: a
    larger micro-batch runs as pieces whose gradients add up to its own, so memory follows this
    budget (or one longer row), not mini_batch_size. 1024 costs SmolLM2-135M ~4% of the update's
    time against 2048 and 1.3 GB less peak memory, 512 costs 25%."""
    packing: Literal["auto", "on", "off"] = "off"
    """Padding-free batches in the logprobs stage and the update (docs/performance.md): auto packs
    where the model's attention allows (SDPA through transformers' attention interface, no sliding
    window), on requires it, off (default: the update's token-budget pieces already leave little
    padding, 8.5 % on the bench's uneven mix, none at equal lengths) pads rows."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the layer there (HF's
    gradient checkpointing, non-reentrant): the update's activations shrink to ~1/10 for about a
    third more update time. Unpacked, a group's prompt then runs once per row (no KV cache)."""
    old_logprobs: Literal["auto", "pass"] = "auto"
    """Where the update's old-policy logprobs (the ratio's denominator) come from. `pass`: a
    separate teacher-forced pass in the logprobs stage. `auto` (default): the same, except when
    every epoch makes one optimizer step (mini_batch_size >= the iteration's completions), with no
    LoRA dropout and no KL in the reward. Then the first epoch's forwards all run on the old policy
    (its one step comes after them): the update uses them, detached, as the old logprobs (TRL does
    this for one epoch), later epochs reuse them, and the values used are stored in
    iter-K/update/old_logprobs.parquet; the logprobs stage then skips that pass."""
    keep_states: int = Field(1, ge=1)
    """Trainer states (optimizer, scheduler) kept on disk; older iterations' states are pruned."""
    lora: LoraSpec | None = None
    """LoRA adapters instead of full fine-tuning; None (default) trains every weight. The base is
    policy/iter-0000 and the reference is the base with the adapter off; policies K >= 1 are adapters."""
    keep_policies: KeepPoliciesConfig = KeepPoliciesConfig()
    """Policy retention: keep the last K policies and every N-th (default: keep all)."""
    max_staleness: int = Field(0, ge=0, le=16)
    """s: iteration k samples from policy max(0, k - s), so `iterate` samples k+1 while k trains
    (pipeline/staleness.py); 0 (default) samples from policy k, strictly on-policy."""


class TrackingConfig(_Section):
    """MLflow tracking."""

    mlflow: bool = True
    """Log to MLflow."""
    mlflow_uri: str | None = None
    """Tracking URI; None uses MLFLOW_TRACKING_URI or else a store inside the run directory."""
    experiment: str = "grpo"
    """MLflow experiment name."""
    sample_completions: int = Field(16, ge=0)
    """Completions logged per iteration as an MLflow table."""
    plots_every: int = Field(10, ge=0)
    """Redraw the PNG plots and diagnostics.json every N iterations (0: only when `grpo iterate`
    ends); drawing them reads the whole history, so it is not done per stage."""


class Config(_Section):
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

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        if self.train.mini_batch_size % self.train.grad_accum:
            raise ValueError(
                f"train.mini_batch_size ({self.train.mini_batch_size}) must be divisible by train.grad_accum ({self.train.grad_accum})"
            )
        if not self.rewards and self.rollout.environment is None:
            raise ValueError("rewards: at least one reward function (or a rollout.environment class with get_reward)")
        names = [r.column for r in self.rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rewards: duplicate reward name {dup[0]!r}; give each a distinct `name`")
        if self.data.eval is not None and (why := eval_refusal(self.data.eval, self.eval, names)):
            raise ValueError(why)
        if self.train.lora is not None and self.ref_model is not None:
            raise ValueError("train.lora: the reference is the base with the adapter off; leave ref_model unset")
        if self.rollout.lora_mode == "vllm_lora" and (self.train.lora is None or self.rollout.engine != "vllm"):
            raise ValueError("rollout.lora_mode vllm_lora needs train.lora and rollout.engine vllm")
        if self.rollout.weight_sync == "memory" and self.train.lora is not None:
            raise ValueError("rollout.weight_sync memory hands over full weights; with train.lora use weight_sync disk")
        if self.loss.type == "reinforce" and self.train.epochs > 1:
            raise ValueError("loss.type reinforce has no importance ratio; use train.epochs 1")
        if why := self.loss.rollout_correction.refusal(self.rollout.top_p, self.rollout.top_k, self.rollout.min_p):
            raise ValueError(why)
        if self.cluster.executor == "ray" and self.train.max_staleness:
            raise ValueError("cluster.executor ray runs on-policy iterations; with train.max_staleness use the local executor")
        if self.rollout.agentic and not self.data.chat_template:
            raise ValueError("rollout.tools / rollout.environment need chat prompts; set data.chat_template: true")
        if (problem := uncorrectable(self)) is not None:
            raise ValueError(problem)
        return self

    @property
    def ref_model_path(self) -> str:
        return self.ref_model or self.model

    def eval_sets(self) -> list[SetRef]:
        """data.eval as the sets the eval runs (pipeline/eval/config.py)."""
        return eval_sets(self.data.eval, self.eval)

    @property
    def uses_ref(self) -> bool:
        return self.loss.kl_coef > 0 or self.advantages.kl_in_reward.coef > 0

    @property
    def old_from_update(self) -> bool:
        """Whether the update takes the old logprobs from its own forward (`train.old_logprobs`)."""
        t = self.train
        one_step = self.rollout.prompts_per_iter * self.rollout.num_generations <= t.mini_batch_size  # per epoch
        no_dropout = t.lora is None or t.lora.dropout == 0
        return t.old_logprobs == "auto" and one_step and no_dropout and self.advantages.kl_in_reward.coef == 0


def resolve(tree: dict, sets: list[str] | None = None, source: str = "config", sources: dict[str, str] | None = None) -> Config:
    """Validate a raw config tree with overrides applied; one-line GRPOError on failure, from
    `source` (or the `sources` entry of the key at fault, see `format_error`)."""
    tree = json.loads(json.dumps(tree))  # deep copy, plain types only
    for key, raw in parse_overrides(sets):
        set_dotted(tree, key, raw)
    try:
        return Config.model_validate(tree)
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
    ("rollout", "enforce_eager"): None,  # eager on the CPU, as before; on a GPU, CUDA graphs
    ("rollout", "weight_sync"): "disk",
    **EVAL_NEUTRAL,
    ("cluster",): ClusterConfig().model_dump(mode="json"),  # where the stages run: out of the hash at any value (canonical)
}
"""Options added after runs already existed, with the value that does what runs did before them:
left out of the canonical form at that value, so the config hash of a run made before the option
(its config.yaml lacks it) stays the one its manifests were written with; and a stored config.yaml
that lacks one is read with that value (`from_yaml_text`), even where a new run's default differs."""


def canonical(cfg: Config) -> str:
    """Canonical JSON of the resolved config: sorted keys, defaults filled in (but for
    `ADDED_OPTIONS` at their earlier behaviour)."""
    tree = cfg.model_dump(mode="json")
    tree.pop("cluster", None)  # where the stages run, not what they compute: a Ray run writes a local run's bytes
    for (*path, key), neutral in ADDED_OPTIONS.items():
        section = tree
        for part in path:
            section = section.get(part) or {}
        if key in section and section[key] == neutral:
            del section[key]
    return json.dumps(tree, sort_keys=True, separators=(",", ":"))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(canonical(cfg).encode()).hexdigest()


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
    return resolve(tree, None, source=source)
