"""Policy K+1 straight from the optimizer's fp32 master weights, written in one pass.

Where the weights are whole in this process (one rank, ZeRO 0-2) the published policy is made of
views of the optimizer's fp32 master: nothing is consolidated from a DeepSpeed checkpoint (which
needed the checkpoint written and read back first). Each optimizer keeps its master in its own
place (DeepSpeed 0.19.8):
- no bf16, ZeRO 0: torch's AdamW steps the module's own fp32 parameters;
- bf16, ZeRO 0: `FP16_UnfusedOptimizer` (`fp16_groups[i][j]` -> `fp32_groups[i][j]`), or
  `BF16_Optimizer` (`bf16_groups[i][j]` -> `fp32_groups_flat_partition[i]` at the parameter's place);
- ZeRO 1/2 (fp32 or bf16): `DeepSpeedZeroOptimizer`, one flat fp32 partition per group
  (`single_partition_of_fp32_groups[i]`), each parameter at its place in the flat 16/32-bit group
  (one rank: the partition is the whole group).
ZeRO 3 and several ranks hold a slice each: their policy is consolidated as before (`None` here).
"""

from __future__ import annotations

import torch


def fp32_masters(engine, world: int, zero_stage: int) -> dict[int, torch.Tensor] | None:
    """{id(module parameter): its fp32 master weight} for every parameter the optimizer steps,
    or None where the weights are not whole in this process."""
    if world > 1 or zero_stage >= 3:
        return None
    opt = engine.optimizer
    masters: dict[int, torch.Tensor] = {}
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        for params, flat, fp32 in zip(opt.bit16_groups, opt.bit16_groups_flat, opt.single_partition_of_fp32_groups):
            base = flat.storage_offset()
            for p in params:
                off = p.data.storage_offset() - base
                masters[id(p)] = fp32.narrow(0, off, p.numel()).view(p.shape)
    elif hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer (bf16, ZeRO 0)
        for low, high in zip(opt.fp16_groups, opt.fp32_groups):
            for p, m in zip(low, high):
                masters[id(p)] = m.data
    elif hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        for params, flat, fp32 in zip(opt.bf16_groups, opt.bf16_groups_flat, opt.fp32_groups_flat_partition):
            base = flat.storage_offset()
            for p in params:
                masters[id(p)] = fp32.narrow(0, p.data.storage_offset() - base, p.numel()).view(p.shape)
    else:  # a plain torch optimizer steps the module's own parameters
        for p in engine.module.parameters():
            if p.requires_grad:
                masters[id(p)] = p.data
    for t in masters.values():
        if t.dtype != torch.float32:
            return None  # not an fp32 master after all: the caller consolidates
    return masters


def master_state_dict(module, masters: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every stepped parameter replaced by its fp32 master (tied names
    share one tensor, as they share one parameter); frozen ones (a LoRA base) as they are."""
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out[name] = masters.get(id(t), t.data if isinstance(t, torch.nn.Parameter) else t)
    return out
