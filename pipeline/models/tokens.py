"""Per-token logprobs of completions under a causal LM, as plain torch (no I/O): the one
computation the logprobs stage and the update share. Batches live on the model's device.

The LM head runs over completion tokens only, a chunk at a time, so the [B, T, V] logits of a
batch are never held (`token_logprobs`); `budget_batches` cuts rows into padded batches of at
most a token budget; `resolve_precision` says whether this machine runs the decoder in bf16.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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

    def to(self, device) -> "Batch":
        """The same batch on `device` (the model's: a GPU where the trainer runs on one)."""
        return Batch(*(getattr(self, f).to(device) for f in ("input_ids", "attention_mask", "completion_mask", "completion_ids", "starts")))


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
    dev = batch.input_ids.device
    with autocast(precision):
        hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state  # [B, L, H]
    H = hidden.shape[-1]
    # the logit predicting completion token t sits at position start + t - 1
    pos = (batch.starts.unsqueeze(1) - 1 + torch.arange(T, device=dev).unsqueeze(0)).clamp(max=hidden.shape[1] - 1)  # [B, T]
    flat = batch.completion_mask.reshape(-1).nonzero().squeeze(-1)  # [N] active (b, t) in B*T order
    rows = (pos + torch.arange(B, device=dev).unsqueeze(1) * hidden.shape[1]).reshape(-1)[flat]  # [N] into [B*L]
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
        return torch.zeros(B * T, dtype=torch.float32, device=dev).index_put((flat,), vals.float()).reshape(B, T)

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
