"""The `train:` section: the policy update (stage 4), its LoRA adapters and policy retention."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section


ALL_LINEAR = "all-linear"


class LoraSpec(Section):
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


class KeepPoliciesConfig(Section):
    """Policy retention: which stored policies keep their weights (see pipeline/run/retention.py)."""

    last: int | None = Field(None, ge=1)
    """Keep the weights of the newest `last` policies; None (the default) keeps every policy.
    Older ones are pruned after each update: their MANIFEST.json (file hashes) stays, so audit
    still checks the lineage; policy/iter-0000 is always kept."""
    every: int = Field(0, ge=0)
    """Also keep every N-th policy (iter-K with K % N == 0), as milestones; 0 keeps none
    beyond `last` and iter-0000. Only read when `last` is set."""


class TrainConfig(Section):
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
    window, no dynamic or longrope rope), on requires it (checked at `grpo init`), off (default: the update's token-budget pieces already leave little
    padding, 8.5 % on the bench's uneven mix, none at equal lengths) pads rows."""
    cpu_attention: Literal["auto", "sdpa"] = "auto"
    """The update's attention kernel on a CPU. auto (default): SDPA's math kernel for a piece whose
    longest row (prompt and completion) is at most 128 tokens, where its backward is ~1.6x faster
    than the flash kernel torch picks (25 % of the demo's update went to that backward), torch's
    choice otherwise; sdpa: torch's choice everywhere (runs made before this option). Other bits
    either way, so it is in the config hash; a GPU keeps torch's choice."""
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
    """Trainer states (optimizer, scheduler) kept on disk; older iterations' states are pruned. Out of the config hash, as state_every and keep_policies are: they change what the record keeps, not a byte of the run."""
    state_every: int = Field(10, ge=1)
    """Write the trainer state (Adam moments, step counters: for SmolLM2-135M 1.1 GB more than the
    policy) after every N-th update, and always at the end of a command and on Ctrl-C; policy K+1
    (the fp32 master) is written after every update. A run killed between two states resumes by
    re-running the missing updates from their stored parts, each checked against the policy hash
    it recorded, so a kill costs at most N-1 updates' compute, never correctness. 10 (default):
    the state's write leaves the loop's critical path on 9 iterations of 10, a kill re-runs at
    most 9 updates (a few seconds each at the sizes this project targets). ZeRO-3 and several
    ranks write it every update (their policy is consolidated from it)."""
    lora: LoraSpec | None = None
    """LoRA adapters instead of full fine-tuning; None (default) trains every weight. The base is
    policy/iter-0000 and the reference is the base with the adapter off; policies K >= 1 are adapters."""
    keep_policies: KeepPoliciesConfig = KeepPoliciesConfig()
    """Policy retention: keep the last K policies and every N-th (default: keep all)."""
    max_staleness: int = Field(0, ge=0, le=16)
    """s: iteration k samples from policy max(0, k - s), so `iterate` samples k+1 while k trains
    (pipeline/schedule.py); 0 (default) samples from policy k, strictly on-policy."""
