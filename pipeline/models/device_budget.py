"""How the engines and the trainer use the machine, decided from facts passed in.

Every decision here is a plain function of a `Device` (cpu, or cuda with its memory), the
model's config.json and the run's settings, so each can be checked on a machine without a GPU;
`this_device()` is the one place that asks torch what the machine is.

On a CPU nothing changes from before: vLLM runs eager, sizes its KV cache from
`kv_cache_memory_bytes`, and an idle engine gives its memory back through
pipeline.models.engine_memory. On CUDA: CUDA graphs unless `rollout.enforce_eager`; vLLM's sleep
mode while `iterate` trains; `rollout.gpu_memory_utilization` derived so the trainer that shares
the GPU keeps its room; bf16 where the GPU computes in it; NCCL for DeepSpeed.

The memory figures are estimates (documented per function, docs/gpu.md); they are meant to
catch a split that cannot fit before anything loads, not to pack the GPU to the last MiB.
"""

from __future__ import annotations

import os

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import GRPOError

GiB = 1 << 30
VLLM_UTILIZATION = 0.9
"""vLLM's own default fraction, and the most `gpu_memory_utilization` is derived to."""
CPU_UTILIZATION = 0.5
"""What the CPU path passes, as it always has (vLLM's CPU backend sizes the KV cache from
`kv_cache_memory_bytes` instead)."""
ENGINE_OVERHEAD = 1 * GiB
"""vLLM beyond weights and KV cache: CUDA context, its profiling forward, CUDA graphs' pool."""
ACTIVATION_BYTES = 90
"""Bytes the update keeps per token of a piece, per layer and per unit of hidden size: the slope
of a two-term fit (with `ACTIVATION_FIXED`) to the peak RSS above the loaded model while one packed
row runs forward and backward (`python -m bench.long --one fit N`: SmolLM2-135M, hidden 576,
30 layers, fp32, lean forwards, the chunked head with its entropy, the GRPO loss, one thread, a
fresh process per size). Less the gradients (513 MiB, in `resident`) and the head's chunk:
983 MiB at 512 tokens, 2391 at 1536, 4779 at 3072; least squares gives 90.3 bytes x 576 x 30
per token over 177 MiB, within 3 % of each point."""
ACTIVATION_FIXED = 320 * (1 << 20)
"""The part of the update's peak that does not grow with tokens (allocator, oneDNN scratch): at 90
bytes a token, 224 MiB covers the three one-row points; a whole update (`make bench-long`, 8 rows of
2108 tokens, packed, one row a piece, then AdamW's step) peaked at 5356 MiB above the model = 513
gradients + 1026 moments (both in `resident`) + 3127 (90 bytes x 2108 tokens) + 384 head chunk +
306 left over, so 320 MiB, and the estimate is at or above every measured peak."""
CHUNK_TOKENS = 1024
"""Completion tokens per pass through the LM head (pipeline.models.tokens): the [tokens, V] logits
of one chunk are the largest tensor a logprob computation holds, whatever the batch (1024 x 49k
fp32 = 200 MB)."""
CHECKPOINTED_SHARE = 0.1
"""Activations kept under train.gradient_checkpointing, against without (the option's note)."""


@dataclass(frozen=True)
class Device:
    """The facts the decisions need: cpu or cuda, one GPU's memory, and bf16 arithmetic."""

    kind: str  # "cpu" | "cuda"
    total_bytes: int = 0  # one GPU's memory; 0 on a CPU
    bf16: bool = False  # the hardware computes in bf16 (a GPU that supports it; AVX512-bf16 or AMX)

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    def gib(self) -> str:
        return f"{self.total_bytes / GiB:.1f} GiB"


@functools.lru_cache(maxsize=1)
def may_have_gpu() -> bool:
    """Whether this machine may have an NVIDIA GPU (its driver is loaded), asked without torch:
    where it says no, `grpo init` needs no torch to know there is no GPU to check."""
    return os.path.exists("/proc/driver/nvidia")


def this_device() -> Device:
    """This process's device: GPU 0 when CUDA is available, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return Device("cuda", int(torch.cuda.get_device_properties(0).total_memory), bool(torch.cuda.is_bf16_supported()))
    cpu = torch.cpu
    fast = any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return Device("cpu", 0, fast)


def resolve_precision(precision: str, device: Device) -> str:
    """`train.precision` on `device`: auto -> bf16 where the hardware computes in bf16, else fp32."""
    if precision != "auto":
        return precision
    return "bf16" if device.bf16 else "fp32"


def engine_dtype(dtype: str, precision: str, device: Device | None = None) -> str:
    """The engine's dtype: `rollout.dtype`, or for auto the trainer's arithmetic on `device`
    (bfloat16 where `train.precision` resolves to bf16 autocast, else float32). Without a
    `device` this machine's is asked (which imports torch) only when both settings are auto."""
    if dtype != "auto":
        return dtype
    if precision == "auto" and device is None:
        device = this_device()
    return "bfloat16" if resolve_precision(precision, device) == "bf16" else "float32"


def dist_backend(device: Device) -> str:
    """DeepSpeed's process-group backend: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device.cuda else "gloo"


def enforce_eager(device: Device, option: bool | None) -> bool:
    """Eager on a CPU always (vLLM's CPU path here has no graphs to capture); on CUDA
    `rollout.enforce_eager`, CUDA graphs when it is unset."""
    return True if not device.cuda else bool(option)


def sleep_level(device: Device, lora_mode: str) -> int | None:
    """vLLM's sleep level while `iterate` trains beside the engine, or None on a CPU (there the
    engine frees its own memory, pipeline.models.engine_memory). Level 2 discards weights and
    KV cache: each iteration replaces the weights anyway. Level 1 keeps the weights (offloaded to
    host memory) and discards the KV cache: an engine serving LoRA adapters (vllm_lora) keeps
    its base, which no iteration reloads."""
    if not device.cuda:
        return None
    return 1 if lora_mode == "vllm_lora" else 2


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimates read from a model's config.json."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, conf: dict) -> "ModelShape":
        """A decoder's parameter count from its config: embedding (and an untied LM head), per
        layer the attention projections (q, o: hidden^2; k, v: hidden x KV width), the gated MLP
        (3 x hidden x intermediate) and two norms, and the final norm."""
        conf = conf.get("text_config", conf)
        h = int(conf["hidden_size"])
        heads = int(conf.get("num_attention_heads") or 1)
        kv_heads = int(conf.get("num_key_value_heads") or heads)
        head_dim = int(conf.get("head_dim") or h // heads)
        inter = int(conf.get("intermediate_size") or 4 * h)
        layers = int(conf.get("num_hidden_layers", 1))
        vocab = int(conf.get("vocab_size", 0))
        per_layer = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h
        embed = vocab * h * (1 if conf.get("tie_word_embeddings", False) else 2)
        return cls(embed + layers * per_layer + h, layers, h, inter, vocab, kv_heads, head_dim)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelShape":
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * _bytes(dtype)

    def lora_params(self, r: int) -> int:
        """An all-linear adapter's parameters (an upper bound for fewer target modules): r x
        (in + out) for q, k, v, o, gate, up and down in every layer."""
        q = self.hidden + self.hidden
        kv = self.hidden + self.kv_heads * self.head_dim
        mlp = self.hidden + self.intermediate
        return r * self.layers * (2 * q + 2 * kv + 3 * mlp)


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def trainer_bytes(shape: ModelShape, policy, device: Device, world: int = 1) -> tuple[int, int]:
    """(resident, peak) GPU bytes of `iterate`'s side beside the engine: the trainer's weights,
    gradients and AdamW states, and the logprob models `iterate` keeps; the peak adds the
    update's activations for one piece (`piece_tokens`, plus `ACTIVATION_FIXED`) and the LM head's fp32 logits and their
    gradient for one chunk of at most `CHUNK_TOKENS` tokens.

    Full fine-tuning: fp32 weights, gradients, two moments = 16 bytes per parameter; with
    train.bf16, bf16 weights and gradients, fp32 master, fp32 gradient accumulator and moments =
    20; ZeRO stage >= 1 splits the optimizer's share over `world` ranks, >= 2 the gradients,
    3 the weights. LoRA: the frozen base (linears in bf16 under bf16 precision) and 16 bytes per
    adapter parameter. `policy`: the run's policy kind (pipeline/run/policy.py), which holds its config and
    its share of these figures."""
    cfg = policy.cfg
    t = cfg.train
    bf16 = resolve_precision(t.precision, device) == "bf16"
    resident, kept, per_token = policy.trainer_bytes(shape, bf16, world, ACTIVATION_BYTES)
    tokens = piece_tokens(cfg)
    act = per_token * shape.layers * tokens
    act = (int(act * CHECKPOINTED_SHARE) if t.gradient_checkpointing else act) + ACTIVATION_FIXED
    head = 2 * 4 * min(tokens, CHUNK_TOKENS) * shape.vocab  # one chunk's [tokens, V] fp32 logits and their gradient
    return resident + kept, resident + kept + act + head


def piece_tokens(cfg) -> int:
    """The most tokens one forward/backward piece of the update holds: train.update_token_budget,
    or one row alone when a row is longer (a prompt allowance, or rollout.max_model_len, plus the
    longest completion): memory grows with the real tokens of the longest row, not with V x it.
    A piece never holds more than its micro-batch (mini_batch_size / grad_accum rows; their
    groups' prompts counted once where the trainer shares them, pipeline.update.trainer), so a
    budget larger than the micro-batch does not count tokens no piece can hold."""
    from pipeline.models.engine_memory import PROMPT_ALLOWANCE

    t, r = cfg.train, cfg.rollout
    row = r.max_model_len or PROMPT_ALLOWANCE + r.completion_budget()
    rows = max(1, t.mini_batch_size // t.grad_accum)
    if r.max_model_len or t.gradient_checkpointing:  # a row's length is all it says / prompts maybe not shared (unpacked)
        micro = rows * row
    else:  # a group's prompt runs once per piece: ceil(rows / G) prompts, every row's completion
        micro = -(-rows // r.num_generations) * PROMPT_ALLOWANCE + rows * r.completion_budget()
    return max(row, min(t.update_token_budget, micro))


def engine_min_bytes(shape: ModelShape, dtype: str, max_model_len: int, tensor_parallel: int = 1) -> int:
    """The least vLLM runs with on one GPU: its share of the weights, one max_model_len sequence
    of KV cache, and `ENGINE_OVERHEAD`."""
    weights = shape.params * _bytes(dtype) // tensor_parallel
    return weights + shape.kv_bytes_per_token(dtype) * max_model_len // tensor_parallel + ENGINE_OVERHEAD


def margin_bytes(device: Device) -> int:
    """Memory left to neither side: allocator fragmentation, NCCL buffers, a second context."""
    return max(GiB, device.total_bytes // 20)


def check_trainer(peak: int, device: Device) -> None:
    """The trainer's peak (`trainer_bytes`) fits on one GPU, less the margin."""
    if device.cuda and peak + margin_bytes(device) > device.total_bytes:
        raise GRPOError(f"GPU ({device.gib()}): the trainer needs ~{peak / GiB:.1f} GiB at its peak (weights, gradients, "
                        "optimizer, logprob models, activations of the longest piece), more than the GPU holds; use train.lora, "
                        "train.gradient_checkpointing, a lower train.update_token_budget or rollout.max_new_tokens, or a smaller model")


@dataclass(frozen=True)
class EngineSettings:
    """How one vLLM engine starts on this device."""

    enforce_eager: bool
    sleep_level: int | None  # vLLM sleep mode's level between rollouts; None: the CPU release
    gpu_memory_utilization: float
    kv_cache_bytes: int | None  # vLLM's kv_cache_memory_bytes; None: sized from the fraction
    dtype: str


def engine_settings(rollout, device: Device, dtype: str, engine_min: int, kv_bytes: int | None,
                trainer: tuple[int, int] | None = None) -> EngineSettings:
    """The engine's settings on `device`. `trainer`: (resident, peak) bytes of a trainer sharing
    the GPU (`iterate`), None for an engine alone; `kv_bytes`: the CPU KV cache's size
    (engine_memory.kv_cache_bytes). Raises a one-line GRPOError for a split that cannot fit."""
    eager = enforce_eager(device, rollout.enforce_eager)
    level = sleep_level(device, rollout.lora_mode)
    if not device.cuda:
        return EngineSettings(eager, level, rollout.gpu_memory_utilization or CPU_UTILIZATION, kv_bytes, dtype)
    total, margin = device.total_bytes, margin_bytes(device)
    given = rollout.gpu_memory_utilization
    kv = int(rollout.kv_cache_gib * GiB) if rollout.kv_cache_gib is not None else None
    need = f"its weights ({dtype}) and one rollout.max_model_len sequence of KV cache"
    if trainer is not None:
        resident, peak = trainer
        what = f"the trainer needs ~{resident / GiB:.1f} GiB beside the engine (weights, gradients, optimizer, logprob models)"
        check_trainer(peak, device)
        if given is None:
            util = min(VLLM_UTILIZATION, (total - resident - margin) / total)
            if util * total < engine_min:
                raise GRPOError(f"GPU ({device.gib()}): {what}, and vLLM at least {engine_min / GiB:.1f} GiB ({need}): "
                                "they cannot share it; use train.lora, a lower rollout.max_model_len, a smaller model, "
                                "or run grpo rollout and grpo update as separate commands")
            return EngineSettings(eager, level, round(util, 4), kv, dtype)
        if given * total + resident + margin > total:
            raise GRPOError(f"rollout.gpu_memory_utilization {given} leaves {(1 - given) * total / GiB:.1f} GiB of the "
                            f"{device.gib()} GPU, and {what}; lower it or leave it unset to derive it")
    util = given if given is not None else VLLM_UTILIZATION
    if util * total < engine_min:
        raise GRPOError(f"rollout.gpu_memory_utilization {util} gives vLLM {util * total / GiB:.1f} GiB of the "
                        f"{device.gib()} GPU, less than the {engine_min / GiB:.1f} GiB it needs ({need})")
    return EngineSettings(eager, level, util, kv, dtype)


def engine_settings_for(rollout, model_dir: Path, max_model_len: int, precision: str, device: Device, shared_with=None) -> EngineSettings:
    """`engine_settings` for the model in `model_dir`; `shared_with`: the run's policy kind when its
    trainer shares the GPU (`iterate`), None for an engine alone."""
    from pipeline.models.engine_memory import kv_cache_bytes

    dtype = engine_dtype(rollout.dtype, precision, device)
    shape = ModelShape.from_dir(model_dir)
    kv = None if device.cuda else kv_cache_bytes(rollout, model_dir, max_model_len, dtype)
    trainer = trainer_bytes(shape, shared_with, device) if shared_with is not None else None
    return engine_settings(rollout, device, dtype, engine_min_bytes(shape, dtype, max_model_len, rollout.tensor_parallel_size),
                       kv, trainer)
