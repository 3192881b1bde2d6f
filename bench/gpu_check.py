"""The update's arithmetic on a GPU, checked against the same arithmetic on the CPU.

    python -m bench.gpu_check        # on a machine with CUDA; exits 1 with the first mismatch

A LoRA adapter (PEFT) on a small random Qwen2, a batch of prompt+completion rows: the chunked
per-token logprobs (`pipeline.models.tokens.token_logprobs`, the LM head a chunk at a time under
activation checkpointing), the clipped-surrogate loss with KL (`pipeline.objective.loss.policy_loss`) and the
adapter's gradient are computed on CUDA and on the CPU from the same weights, in fp32 and under bf16
autocast (what `train.precision: auto` picks on a GPU). It needs torch, transformers and peft
only, so it runs on a bare GPU image; vLLM and DeepSpeed are not exercised here.
"""

from __future__ import annotations

import sys


def run(device: str, precision: str, seed: int = 0) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.objective import loss as grpo
    from pipeline.config.loss import LossConfig
    from pipeline.models.tokens import Batch, token_logprobs

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                               init_lora_weights="gaussian")).to(device)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (5, 9, 7, 3)]
    comps = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (12, 4, 1500, 8)]  # 1500: several head chunks
    batch = Batch.build(prompts, comps).to(device)
    logp, ent = token_logprobs(model, batch, temperature=0.9, with_entropy=True, chunk=512, precision=precision)
    old = (logp.detach() + 0.01 * batch.completion_mask).contiguous()
    ref = (logp.detach() - 0.02 * batch.completion_mask).contiguous()
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75], device=device)
    loss, _ = grpo.policy_loss(logp, old, adv, batch.completion_mask, LossConfig(kl_coef=0.05), ref_logprobs=ref)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return {"logp": logp.detach().cpu(), "entropy": ent.detach().cpu(), "loss": float(loss.detach()), "grads": grads,
            "device": str(logp.device)}


def main() -> int:
    import torch

    from pipeline.models.tokens import resolve_precision

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here")
        return 1
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, train.precision auto -> {resolve_precision('auto')}")
    failures = 0
    for precision, atol in (("fp32", 2e-4), ("bf16", 5e-2)):
        cpu, gpu = run("cpu", "fp32"), run("cuda", precision)
        assert gpu["device"].startswith("cuda"), gpu["device"]
        d_logp = float((cpu["logp"] - gpu["logp"]).abs().max())
        d_ent = float((cpu["entropy"] - gpu["entropy"]).abs().max())
        d_loss = abs(cpu["loss"] - gpu["loss"])
        g_cpu = torch.cat([g.flatten() for g in cpu["grads"].values()])
        g_gpu = torch.cat([g.flatten() for g in gpu["grads"].values()])
        rel = float((g_cpu - g_gpu).norm() / g_cpu.norm())
        ok = d_logp <= atol and d_ent <= 10 * atol and d_loss <= atol and rel <= (1e-3 if precision == "fp32" else 5e-2) and g_cpu.norm() > 0
        failures += not ok
        print(f"{precision:>5} on cuda vs fp32 on cpu: max |logp diff| {d_logp:.2e}, max |entropy diff| {d_ent:.2e}, "
              f"|loss diff| {d_loss:.2e}, adapter grad rel. diff {rel:.2e} ({len(cpu['grads'])} tensors) -> {'ok' if ok else 'MISMATCH'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
