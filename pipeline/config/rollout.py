"""The rollout section of the run's configuration (`rollout:` in the YAML); pipeline.config
holds the rest of the tree and the rules across sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.agents import AgentOptions


class RolloutConfig(AgentOptions):
    """Sampling of G completions per prompt (stage 1); with tools or an environment, G multi-turn
    episodes (the options in pipeline.config.agents)."""

    engine: Literal["vllm", "hf"] = "vllm"
    """Generation engine: vllm (default) or hf (transformers generate, for machines without vLLM)."""
    hf_sampler: Literal["batched", "per_group", "gumbel"] | None = "batched"
    """engine hf: how a call's groups are drawn, each from its own seed either way. batched
    (default): every group of the call in one left-padded `generate` batch, a row's token drawn by
    inverse CDF from one uniform of its group's own generator (one pass over the vocabulary for
    all rows, as TRL's one `generate` batch costs); per_group: one `generate` per group under the
    group's seed with transformers' own sampler; gumbel: one batch, Gumbel-max with each group's
    generator filling its rows' noise (a vocabulary of uniforms per row). null: as runs made before
    this option, per_group on a CPU and gumbel on a GPU. Each is exact (tests hold each to a plain
    reference); they draw different tokens from the same seed, so the value is in the config hash:
    `grpo init` again on an HF-engine run made before it needs `rollout.hf_sampler: null` in the YAML."""
    num_generations: int = Field(8, ge=2, le=1024)
    """G: completions sampled per prompt; the group whose rewards are normalised together."""
    prompts_per_iter: int = Field(16, ge=1)
    """Prompts drawn per iteration (epoch-wise shuffle of data.train, seeded by `seed`)."""
    groups_per_part: int = Field(64, ge=1)
    """Groups (prompts) per Parquet part; parts are the unit of sharding and of resume."""
    max_new_tokens: int = Field(64, ge=1)
    """Maximum completion length in tokens; longer completions are truncated (finish_reason=length)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; logprobs are computed from logits divided by it, as TRL does."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Min-p sampling; 0 disables."""
    stop: list[str] = []
    """Extra stop strings (the model's stop tokens always stop: its eos ids and its chat template's end of turn)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype. auto: the trainer's arithmetic (`train.precision` as resolved on this machine),
    bfloat16 where it trains under bf16 autocast, else float32; the sampler then runs at the
    precision the trainer computes its logprobs at, with half the weights and KV cache of fp32."""
    max_model_len: int | None = Field(None, ge=16)
    """vLLM context length; None = longest prompt + max_new_tokens, capped by the model's context."""
    kv_cache_gib: float | None = Field(None, gt=0.0)
    """vLLM CPU KV-cache size in GiB; None = what one part needs: groups_per_part x G sequences
    of (prompt allowance + max_new_tokens) tokens x the model's KV bytes per token, with a floor."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """vLLM's fraction of the GPU's memory (GPU machines only). None = derived: in `iterate`, where
    the trainer shares the GPU, (total - the trainer's estimate - a margin) / total, at most 0.9;
    for a `grpo rollout` alone, vLLM's 0.9. A value given is used as it is; either way a split
    that cannot fit is an error before any engine loads (pipeline/models/device_budget.py)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs. None (default): CUDA graphs on a GPU, eager on a CPU (vLLM's CPU
    path here always runs eager); true: eager everywhere; false: CUDA graphs on a GPU."""
    weight_sync: Literal["auto", "disk", "memory"] = "auto"
    """How `iterate` hands a new policy to its warm engine. memory: the trainer's weights go to the
    engine from memory (vLLM's `reload_weights` with a weights iterator), the stored policy still
    written and hashed as the record, on a thread while the rollout samples; disk: the engine
    reloads the stored policy directory, so the rollout waits for that write; auto (default):
    memory for full fine-tuning, disk with train.lora (whose policy reaches the engine built in
    memory either way). The same bytes either way, so only `memory` is in the config hash (as runs
    made with it hashed it). A separate `grpo rollout` always reads the stored policy."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism (GPU machines)."""
    data_parallel_size: int = Field(1, ge=1)
    """vLLM data parallelism (GPU machines)."""
    lora_mode: Literal["merged", "vllm_lora"] = "merged"
    """With train.lora: how vLLM samples from an adapter policy. merged (default): the adapter is
    merged into the base and loaded in place as plain weights (fastest on CPU); vllm_lora: vLLM's
    own LoRA layers serve the adapter (`enable_lora`, a `LoRARequest` per policy; for GPU machines)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """vllm_lora only: vLLM's max_lora_rank; None = train.lora.r rounded up to a rank vLLM supports."""

    def completion_budget(self) -> int:
        """The most tokens one sample's completion can hold: max_new_tokens, or for episodes their
        whole budget (model turns, template glue and tool results), as TRL's max_completion_length
        bounds a multi-turn completion; Dr. GRPO's fixed normaliser."""
        return self.episode_tokens() if self.agentic else self.max_new_tokens
