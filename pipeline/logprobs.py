"""Stage 3: teacher-forced per-token logprobs of every completion under the old policy and the
reference model, with logits divided by the sampling temperature (as TRL does).

    iter-k/rollout/part-p.parquet --policy/iter-k, ref--> iter-k/logprobs/part-p.parquet

`token_logprobs` is also what the update uses for the current policy, so the two can never
disagree on how a logprob is computed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pipeline.errors import GRPOError
from pipeline.models.lora import AdapterOff, lora_models
from pipeline.store.parts import Shard, read_part, run_parts, upstream
from pipeline.store.run import Run
from schemas.artifacts import LOGPROBS, ROLLOUT


@dataclass
class Batch:
    """Right-padded prompt+completion sequences and where each completion starts."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, T] 1 on completion tokens
    completion_ids: torch.Tensor  # [B, T]
    starts: torch.Tensor  # [B] index in input_ids of the first completion token

    @classmethod
    def build(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int = 0) -> "Batch":
        B = len(prompt_ids)
        L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        T = max(1, max(len(c) for c in completion_ids))
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        comp = torch.full((B, T), pad_id, dtype=torch.long)
        cmask = torch.zeros((B, T), dtype=torch.float32)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            seq = list(p) + list(c)
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            cmask[i, : len(c)] = 1.0
        starts = torch.tensor([len(p) for p in prompt_ids])
        return cls(ids, attn, cmask, comp, starts)


CHUNK_TOKENS = 1024
"""Completion tokens per pass through the LM head: the [tokens, V] logits of one chunk are the
largest tensor a logprob computation holds, whatever the batch (1024 x 49k fp32 = 200 MB)."""


def resolve_precision(precision: str) -> str:
    """`train.precision` on this machine: auto -> bf16 where the hardware computes in bf16."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    cpu = torch.cpu
    fast = any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return "bf16" if fast else "fp32"


def autocast(precision: str):
    """The forward's arithmetic: bf16 autocast (fp32 weights kept) or nothing."""
    if precision == "bf16":
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _head_chunk(head, h: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """logp [n] (and entropy [n]) of tokens `ids` [n] from hidden states h [n, H], in fp32
    whatever the autocast around it: bf16 logits would be off by up to ~0.1 nat at |logit| 20."""
    with torch.autocast(h.device.type, enabled=False):
        w = head.weight
        if hasattr(w, "ds_id"):  # a ZeRO-3 parameter: gathered only by the module's own call (forward and recompute alike)
            logits = head(h.to(w.dtype)).float()
        else:
            logits = torch.nn.functional.linear(h.float(), w.float(), None if head.bias is None else head.bias.float())
    logits = logits / temperature  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse  # [n]
    if not with_entropy:
        return logp, None
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [n]
    return logp, ent


def token_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False, chunk: int = CHUNK_TOKENS,
                   precision: str = "fp32"):
    """Per-token logprobs [B, T] of the completion tokens (and entropies [B, T] if asked).

    Only the completion tokens (not the prompt, not the padding) go through the LM head, `chunk`
    tokens at a time: logp = logit[token] - logsumexp(logits), so neither the [B, T, V] logits nor
    their log-softmax is ever held. Under autograd each chunk is checkpointed: its logits are
    recomputed in the backward pass instead of being kept. Padding positions hold 0.
    `precision` bf16 runs the decoder under bf16 autocast; the LM head and what follows stay fp32.
    """
    B, T = batch.completion_ids.shape
    with autocast(precision):
        hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state  # [B, L, H]
    H = hidden.shape[-1]
    # the logit predicting completion token t sits at position start + t - 1
    pos = (batch.starts.unsqueeze(1) - 1 + torch.arange(T).unsqueeze(0)).clamp(max=hidden.shape[1] - 1)  # [B, T]
    flat = batch.completion_mask.reshape(-1).nonzero().squeeze(-1)  # [N] active (b, t) in B*T order
    rows = (pos + torch.arange(B).unsqueeze(1) * hidden.shape[1]).reshape(-1)[flat]  # [N] into [B*L]
    h = hidden.reshape(-1, H).index_select(0, rows)  # [N, H]
    ids = batch.completion_ids.reshape(-1)[flat]  # [N]
    head = model.get_output_embeddings()
    # ZeRO-3 gathers the head's weight only inside its own module call, and not again when a
    # checkpoint recomputes a chunk in backward: there the chunks' logits are kept instead
    grad = torch.is_grad_enabled() and h.requires_grad and not hasattr(head.weight, "ds_id")
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        args = (head, h[s : s + chunk], ids[s : s + chunk], temperature, with_entropy)
        if grad:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        lps.append(lp)
        ents.append(ent)

    def scatter(parts) -> torch.Tensor:
        # no active token: an empty tensor that still hangs off the graph, so backward() works
        vals = torch.cat(parts) if parts else (hidden.sum() * 0.0).expand(0)
        return torch.zeros(B * T, dtype=torch.float32).index_put((flat,), vals.float()).reshape(B, T)

    return scatter(lps), (scatter(ents) if with_entropy else None)


def budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x longest) fits the token budget."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def sequence_logprobs(model, prompt_ids, completion_ids, temperature: float, budget: int, pad_id: int = 0,
                      precision: str = "fp32") -> list[np.ndarray]:
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    out: list[np.ndarray | None] = [None] * len(lengths)
    for idx in budget_batches(lengths, budget):
        batch = Batch.build([prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], pad_id)
        logp, _ = token_logprobs(model, batch, temperature, precision=precision)
        for j, i in enumerate(idx):
            out[i] = logp[j, : len(completion_ids[i])].numpy().astype(np.float32)
    return out


def logprobs_table(rollout: pa.Table, old_model, ref_model, temperature: float, budget: int, k: int,
                   precision: str = "fp32", ref_is_old: bool = False) -> pa.Table:
    """`ref_is_old`: the reference is the old policy itself (iteration 0 without a separate
    ref_model), so its logprobs are the old ones, computed once."""
    prompts = rollout.column("prompt_ids").to_pylist()
    comps = rollout.column("completion_ids").to_pylist()
    old = sequence_logprobs(old_model, prompts, comps, temperature, budget, precision=precision)
    if ref_model is None:
        ref = None
    elif ref_is_old:
        ref = old
    elif isinstance(ref_model, AdapterOff):  # LoRA: the same loaded base, adapter disabled
        with ref_model.active() as base:
            ref = sequence_logprobs(base, prompts, comps, temperature, budget, precision=precision)
    else:
        ref = sequence_logprobs(ref_model, prompts, comps, temperature, budget, precision=precision)
    sampler = rollout.column("sampler_logprobs").to_pylist()
    for name, values in (("old_logprobs", old), ("ref_logprobs", ref or [])):
        for i, v in enumerate(values):
            if not np.isfinite(v).all():
                raise GRPOError(f"logprobs iteration {k} row {i} (prompt_id {rollout.column('prompt_id')[i]}): {name} has NaN/inf")
    gaps = [np.abs(o - np.asarray(s, np.float32)) if len(o) else np.zeros(1, np.float32) for o, s in zip(old, sampler)]
    return pa.table(
        {
            "prompt_id": rollout.column("prompt_id"),
            "sample_idx": rollout.column("sample_idx"),
            "old_logprobs": pa.array([o.tolist() for o in old], pa.list_(pa.float32())),
            "ref_logprobs": pa.array([r.tolist() for r in ref] if ref is not None else [None] * len(old), pa.list_(pa.float32())),
            "sampler_gap_mean": pa.array([float(g.mean()) for g in gaps], pa.float32()),
            "sampler_gap_max": pa.array([float(g.max()) for g in gaps], pa.float32()),
        }
    )


def run_logprobs(run: Run, k: int, shard: Shard = Shard(), models: dict | None = None) -> dict | None:
    """`models` lets `iterate` pass warm {"old": model, "ref": model} instances."""
    if run.done(k, "logprobs"):
        return run.manifest(k, "logprobs")
    rollout_m = run.require(k, "logprobs", "rollout")
    cfg = run.cfg
    models = dict(models or {})
    stats = {"tokens": 0, "load_s": 0.0}
    precision = resolve_precision(cfg.train.precision)  # the update computes its logprobs the same way

    # at iteration 0 the old policy is the reference (same weights, same arithmetic): one pass
    ref_is_old = cfg.uses_ref and k == 0 and cfg.ref_model is None

    def make_part(p: int) -> pa.Table:
        if "old" not in models:
            t = time.time()
            if cfg.train.lora is not None:
                models.update(lora_models(run, k))
            else:
                models["old"] = load_model(run.policy_dir(k))
                models["ref"] = (models["old"] if ref_is_old else load_model(run.ref_dir())) if cfg.uses_ref else None
            stats["load_s"] += time.time() - t
        rollout = read_part(run, k, "rollout", ROLLOUT, p)
        stats["tokens"] += int(sum(rollout.column("completion_length").to_pylist()))
        return logprobs_table(rollout, models["old"], models.get("ref") if cfg.uses_ref else None, cfg.rollout.temperature,
                              cfg.train.token_budget, k, precision, ref_is_old)

    inputs = {
        "rollout": upstream(run, k, "rollout"),
        "policy_hash": run.policy_hash(k),
        "ref": ("policy/iter-0000 (adapter off)" if cfg.train.lora is not None else "policy/iter-0000") if cfg.ref_model is None else cfg.ref_model,
        "uses_ref": cfg.uses_ref,
        "precision": precision,
    }
    # which policy each column came from, and how many forward passes were made
    passes = {"old_logprobs": f"policy/iter-{k:04d}", "ref_logprobs": None, "forward_passes": 1}
    if cfg.uses_ref:
        passes["ref_logprobs"] = "= old_logprobs (policy/iter-0000 is the reference)" if ref_is_old else inputs["ref"]
        passes["forward_passes"] = 1 if ref_is_old else 2
    return run_parts(run, k, "logprobs", LOGPROBS, len(rollout_m.outputs), shard, inputs, make_part,
                     manifest_extra=lambda: {"stats": stats, "passes": passes})
