"""Per-token logprobs of completions under a causal LM, as plain torch (no I/O): the one
computation the logprobs stage and the update share. Batches live on the model's device.

The LM head runs over completion tokens only, a chunk at a time, so the [B, T, V] logits of a
batch are never held (`token_logprobs`), and each distinct prompt runs once per batch;
`shared_budget_batches` cuts rows into batches of at most a token budget as they are run;
`resolve_precision` says whether this machine runs the decoder in bf16.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from pipeline.models.device_budget import CHUNK_TOKENS  # the memory estimate and the computation share it
from pipeline.models.packing import Packed, packed_hidden


@dataclass
class Prompts:
    """The distinct prompts of a batch, left-padded, and which one each row continues: a group's
    G completions share one prompt, whose forward then runs once instead of G times."""

    input_ids: torch.Tensor  # [P, Lp] left-padded
    attention_mask: torch.Tensor  # [P, Lp]
    row: torch.Tensor  # [B] the prompt (0..P-1) of each batch row

    @classmethod
    def shared(cls, prompt_ids: list[list[int]], pad_id: int = 0) -> "Prompts | None":
        """None when no two rows share a prompt (nothing to gain)."""
        index: dict[tuple, int] = {}
        row = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
        if len(index) == len(prompt_ids) or any(len(p) == 0 for p in index):
            return None
        Lp = max(len(p) for p in index)
        ids = torch.full((len(index), Lp), pad_id, dtype=torch.long)
        attn = torch.zeros((len(index), Lp), dtype=torch.long)
        for p, i in index.items():
            ids[i, Lp - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, Lp - len(p):] = 1
        return cls(ids, attn, torch.tensor(row, dtype=torch.long))

    def to(self, device) -> "Prompts":
        return Prompts(self.input_ids.to(device), self.attention_mask.to(device), self.row.to(device))


@dataclass
class Batch:
    """Right-padded prompt+completion sequences and where each completion starts; `prompts`,
    when rows share prompts (built with `share_prompts`), runs each distinct prompt once."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, T] 1 on completion tokens: the model reads them and their logprobs are computed
    completion_ids: torch.Tensor  # [B, T]
    starts: torch.Tensor  # [B] index in input_ids of the first completion token
    prompts: Prompts | None = None
    loss_mask: torch.Tensor | None = None
    """[B, T] 1 on the completion tokens the model sampled: completion_mask times the episode's
    mask (0 on a tool result the episode put there); what the loss, KL and token counts count."""
    packed: Packed | None = None
    """The rows' real tokens back to back (`pipeline.models.packing`), what the forward runs when set."""

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    @classmethod
    def build(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int = 0,
              share_prompts: bool = False, episode_masks: list | None = None, packed: bool = False) -> "Batch":
        """`episode_masks`: each row's rollout completion_mask (None: every token sampled);
        `packed`: the forward runs the rows padding-free (a shared prompt once when `share_prompts`)."""
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
        loss_mask = cmask
        if episode_masks is not None and any(m is not None for m in episode_masks):
            loss_mask = cmask.clone()  # [B, T]
            for i, m in enumerate(episode_masks):
                if m is not None:
                    loss_mask[i, : len(m)] *= torch.tensor(m, dtype=torch.float32)
        if packed:
            return cls(ids, attn, cmask, comp, starts, None, loss_mask, Packed.build(prompt_ids, completion_ids, share_prompts))
        return cls(ids, attn, cmask, comp, starts, Prompts.shared(prompt_ids, pad_id) if share_prompts else None, loss_mask)

    def to(self, device) -> "Batch":
        """The same batch on `device` (the model's: a GPU where the trainer runs on one)."""
        return Batch(*(getattr(self, f).to(device) for f in ("input_ids", "attention_mask", "completion_mask", "completion_ids", "starts")),
                     prompts=None if self.prompts is None else self.prompts.to(device), loss_mask=self.loss_mask.to(device),
                     packed=None if self.packed is None else self.packed.to(device))


ROW_BLOCK = 128
"""Rows of a chunk's logits that the softmax arithmetic (logsumexp, entropy, their gradient)
works on at a time, in place, so a chunk costs one [tokens, V] buffer and not three."""


def resolve_precision(precision: str, device=None) -> str:
    """`train.precision` on `device` (default: this machine's): auto -> bf16 where the hardware
    computes in bf16 (pipeline.models.device_budget)."""
    from pipeline.models import device_budget

    return device_budget.resolve_precision(precision, device or device_budget.this_device())


def autocast(precision: str):
    """The forward's arithmetic: bf16 autocast (fp32 weights kept) or nothing."""
    if precision == "bf16":
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@functools.cache
def _bf16_matmul_keeps_fp32() -> bool:
    """Whether oneDNN's fp32 matmuls through its bf16 units stay within float noise of fp32 on this
    CPU. They do on AVX512-bf16 machines without AMX (measured ~1e-5 on the head's logits); on AMX
    machines oneDNN rounds the inputs to bf16 instead, and a logprob at |logit| 20 is then 0.04 nat
    off, as large as the sampler gap the rollout correction measures. Probed once per process on
    a head-shaped product (logits of |z| ~ 20)."""
    mkldnn = torch.backends.mkldnn.matmul
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(256, 576, generator=g) * 2.0, torch.randn(2048, 576, generator=g) * 0.1
    exact = torch.nn.functional.linear(h, w)
    before = mkldnn.fp32_precision
    mkldnn.fp32_precision = "bf16"
    try:
        fast = torch.nn.functional.linear(h, w)
    finally:
        mkldnn.fp32_precision = before
    return float((fast - exact).abs().max()) <= 1e-4 * float(exact.abs().max())


@contextlib.contextmanager
def _head_matmul(fast: bool):
    """With `fast` on a CPU whose bf16 units keep fp32 accuracy (`_bf16_matmul_keeps_fp32`),
    oneDNN runs the head's fp32 matmuls through them (fp32 in and out; 2 x faster on
    AVX512-bf16); else unchanged."""
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if not fast or mkldnn is None or not hasattr(mkldnn, "fp32_precision") or not _bf16_matmul_keeps_fp32():
        yield
        return
    before = mkldnn.fp32_precision
    mkldnn.fp32_precision = "bf16"
    try:
        yield
    finally:
        mkldnn.fp32_precision = before


class _Head(torch.autograd.Function):
    """logp [n] (and entropy [n]) of tokens `ids` [n] from hidden states h [n, H] through the LM
    head (weight [V, H], bias or None), in fp32 whatever the autocast around it (bf16 logits
    would be off by up to ~0.1 nat at |logit| 20). Only h, the ids and two numbers per token are
    kept for backward, which recomputes the [n, V] logits once and forms their gradient by hand:
    d logp / dz = onehot - p, d entropy / dz = -p (log p + entropy)."""

    @staticmethod
    def forward(ctx, h, weight, bias, ids, temperature: float, with_entropy: bool, fast: bool):
        z = _logits(h, weight, bias, temperature, fast)  # [n, V]
        lse = torch.cat([torch.logsumexp(zb, dim=-1) for zb in z.split(ROW_BLOCK)])  # [n]
        logp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
        ent = None
        if with_entropy:
            ent = torch.empty_like(lse)
            for zb, lb, eb in zip(z.split(ROW_BLOCK), lse.split(ROW_BLOCK), ent.split(ROW_BLOCK)):
                zb.sub_(lb.unsqueeze(-1))  # log p, in place
                torch.sum(zb.exp().mul_(zb), dim=-1, out=eb).neg_()
        ctx.save_for_backward(h, weight, bias, ids, lse, ent)
        ctx.temperature, ctx.fast = temperature, fast
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, ids, lse, ent = ctx.saved_tensors
        z = _logits(h, weight, bias, ctx.temperature, ctx.fast).sub_(lse.unsqueeze(-1))  # log p [n, V]
        grad = z  # formed in place: one [n, V] buffer
        if g_ent is not None:
            for b, zb in enumerate(z.split(ROW_BLOCK)):
                rows = slice(b * ROW_BLOCK, b * ROW_BLOCK + zb.shape[0])
                p = zb.exp()
                zb.add_(ent[rows].unsqueeze(-1)).mul_(p).mul_(-g_ent[rows].unsqueeze(-1))
                if g_logp is not None:
                    zb.sub_(p.mul_(g_logp[rows].unsqueeze(-1)))
        else:
            z.exp_().mul_(-g_logp.unsqueeze(-1))
        if g_logp is not None:
            grad.scatter_add_(-1, ids.unsqueeze(-1), g_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        with _head_matmul(ctx.fast):
            g_h = grad @ weight.float() if ctx.needs_input_grad[0] else None
            g_w = grad.t() @ h.float() if ctx.needs_input_grad[1] else None
        g_b = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return (None if g_h is None else g_h.to(h.dtype), None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(bias.dtype), None, None, None, None)


def _logits(h, weight, bias, temperature: float, fast: bool) -> torch.Tensor:
    with torch.autocast(h.device.type, enabled=False), _head_matmul(fast):
        z = torch.nn.functional.linear(h.float(), weight.float(), None if bias is None else bias.float())
    return z if temperature == 1.0 else z.div_(temperature)


def _head_chunk(head, h: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """A ZeRO-3 head (its weight gathered only inside its own module call): autograd through
    the module, logits in fp32."""
    with torch.autocast(h.device.type, enabled=False):
        logits = head(h.to(head.weight.dtype)).float() / temperature  # [n, V]
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
    their log-softmax is ever held. Under autograd a chunk keeps only its hidden states: backward
    recomputes its logits (`_Head`). Padding positions hold 0.
    `precision` bf16 runs the decoder under bf16 autocast; the LM head and what follows stay fp32
    (on a CPU, oneDNN computes the head's fp32 matmuls with its bf16 units: `_head_matmul`).
    """
    B, T = batch.completion_ids.shape
    dev = batch.input_ids.device
    flat = batch.completion_mask.reshape(-1).nonzero().squeeze(-1)  # [N] active (b, t) in B*T order
    if batch.packed is not None:
        h = packed_hidden(model.get_decoder(), batch.packed, autocast(precision))  # [N, H]
    else:
        if batch.prompts is not None:
            hidden = _shared_prompt_hidden(model.get_decoder(), batch, precision)  # [B, T, H]
            pos = torch.arange(T, device=dev).unsqueeze(0).expand(B, T)  # the logit predicting token t sits at t
        else:
            with autocast(precision):
                hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state  # [B, L, H]
            # the logit predicting completion token t sits at position start + t - 1
            pos = (batch.starts.unsqueeze(1) - 1 + torch.arange(T, device=dev).unsqueeze(0)).clamp(max=hidden.shape[1] - 1)  # [B, T]
        rows = (pos + torch.arange(B, device=dev).unsqueeze(1) * hidden.shape[1]).reshape(-1)[flat]  # [N] into [B*L]
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [N, H]
    ids = batch.completion_ids.reshape(-1)[flat]  # [N]
    head = model.get_output_embeddings()
    zero3 = hasattr(head.weight, "ds_id")  # gathered only inside the module's own call: autograd through it
    fast = precision == "bf16" and dev.type == "cpu"
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        if zero3:
            lp, ent = _head_chunk(head, h[s : s + chunk], ids[s : s + chunk], temperature, with_entropy)
        else:
            lp, ent = _Head.apply(h[s : s + chunk], head.weight, head.bias, ids[s : s + chunk], float(temperature), with_entropy, fast)
        lps.append(lp)
        ents.append(ent)

    def scatter(parts) -> torch.Tensor:
        # no active token: an empty tensor that still hangs off the graph, so backward() works
        vals = torch.cat(parts) if parts else (h.sum() * 0.0).expand(0)
        return torch.zeros(B * T, dtype=torch.float32, device=dev).index_put((flat,), vals.float()).reshape(B, T)

    return scatter(lps), (scatter(ents) if with_entropy else None)


def _shared_prompt_hidden(decoder, batch: Batch, precision: str) -> torch.Tensor:
    """Hidden states [B, T, H] that predict each completion token, with every distinct prompt run
    once: the prompts' forward fills a KV cache, each row takes its prompt's keys and values
    (an index, so under autograd their gradients add up over the group), and the completions run
    on it at the positions they have after their prompt. The same arithmetic as one forward over
    prompt + completion, without the (G-1)/G of the prompt work; masks and positions follow the
    left-padded prompts."""
    pr = batch.prompts
    T = batch.completion_ids.shape[1]
    with autocast(precision):
        first = decoder(input_ids=pr.input_ids, attention_mask=pr.attention_mask,
                        position_ids=(pr.attention_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        cache = first.past_key_values
        cache.batch_select_indices(pr.row)  # [P, ...] -> [B, ...]
        lengths = pr.attention_mask.sum(-1)[pr.row]  # [B] each row's prompt length
        mask = torch.cat([pr.attention_mask[pr.row], batch.completion_mask.to(pr.attention_mask.dtype)], dim=1)  # [B, Lp + T]
        positions = lengths.unsqueeze(1) + torch.arange(T, device=lengths.device).unsqueeze(0)  # [B, T]
        rest = decoder(input_ids=batch.completion_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).last_hidden_state  # [B, T, H]
    last = first.last_hidden_state[:, -1][pr.row]  # [B, H] the prompt's last token predicts completion token 0
    return torch.cat([last.unsqueeze(1), rest[:, :-1]], dim=1)


def shared_budget_batches(prompt_ids: list[list[int]], completion_ids: list[list[int]], budget: int,
                          shared: bool = True, packed: bool = False) -> list[list[int]]:
    """Consecutive index groups that fit the token budget as `token_logprobs` runs them with
    shared prompts: distinct prompts x longest prompt + rows x longest completion where a prompt
    repeats, rows x longest prompt + completion where none does (or, `shared` False, always);
    `packed`: the real tokens `Packed` lays out (each distinct prompt once when `shared`). Rows
    of one prompt must be adjacent to share it."""
    out: list[list[int]] = []
    cur: list[int] = []
    keys: set = set()
    lp = lc = lpc = real = 0

    def cost(n: int, p: int, a: int, b: int, ab: int, r: int) -> int:
        if packed:
            return r
        return p * a + n * b if shared and p < n else n * ab

    for i, (pi, ci) in enumerate(zip(prompt_ids, completion_ids)):
        key = tuple(pi)
        r = real + max(0, len(ci) - 1) + (len(pi) if key not in keys or not shared else 0)
        new = (len(keys) + (key not in keys), max(lp, len(pi)), max(lc, len(ci)), max(lpc, len(pi) + len(ci)), r)
        if cur and cost(len(cur) + 1, *new) > budget:
            out.append(cur)
            cur, keys = [], set()
            new = (1, len(pi), len(ci), len(pi) + len(ci), len(pi) + max(0, len(ci) - 1))
        cur.append(i)
        keys.add(key)
        _, lp, lc, lpc, real = new
    if cur:
        out.append(cur)
    return out
