"""Padding-free batches (`train.packing`): a batch's rows laid back to back as one sequence of
its real tokens, with position ids that restart per sequence and attention that cannot cross
from one sequence into another. No padding is computed, and a prompt its rows share runs once.

Layout (`Packed.build`): each distinct prompt's tokens, then every completion of that prompt
without its last token (which predicts nothing); positions restart at 0 at each prompt, and a
completion continues at its prompt's length, as it would after the prompt in a padded row:

    tokens     p0 p1 p2 a0 a1 | b0 b1 b2 | q0 q1 c0 ...
    positions   0  1  2  3  4 |  3  4  5 |  0  1  2 ...

The attention (`packed_attention`, registered with transformers as `ATTENTION`) reads the
structure from the position ids alone, as transformers' FlashAttention path cuts `cu_seq_lens`
from them: a position 0 starts a new sequence (a root); a run whose position is not one more
than the token before it is a branch that continues the first `position` tokens of its root
(the shared prompt). Each piece runs as its own SDPA call, causal on its own tokens, so the cost
is the sum of each sequence's attention, linear in the batch's tokens for a given longest row;
transformers' own packed-SDPA route builds a dense [N, N] block-diagonal mask over the whole
packed sequence instead, quadratic in the batch. A sequence can therefore only see itself and
its prompt; with the resets taken out (`reset_positions=False`, the negative control) everything
is one causal sequence and every row after the first reads the rows before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipeline.errors import GRPOError

ATTENTION = "grpo_packed"
"""The attention implementation a packing model runs with: SDPA per packed sequence when a
forward passes `packed=` pieces, transformers' SDPA otherwise (same masks, same arithmetic)."""


@dataclass
class Pieces:
    """The packed sequence's runs, in token order: (start, end, root, prefix) = tokens
    [start, end) attend causally to themselves after the `prefix` first tokens of the root that
    starts at `root` (prefix 0: the run is a root)."""

    runs: list[tuple[int, int, int, int]]
    _masks: dict = field(default_factory=dict, repr=False)
    calls: int = 0
    """Attention layers that ran these pieces (`packed_attention`): `packed_hidden` checks every layer did."""

    @classmethod
    def from_positions(cls, positions: list[int]) -> "Pieces":
        runs, root, root_len, i = [], None, 0, 0
        while i < len(positions):
            j = i + 1
            while j < len(positions) and positions[j] == positions[j - 1] + 1:
                j += 1
            p = positions[i]
            if p == 0:
                root, root_len = i, j - i
                runs.append((i, j, i, 0))
            elif root is None or p > root_len:
                raise ValueError(f"packed position ids: the run at token {i} continues position {p - 1}, past its sequence")
            else:
                runs.append((i, j, root, p))
            i = j
        return cls(runs)

    def mask(self, n: int, prefix: int, device) -> torch.Tensor:
        """[n, prefix + n] bool: all of the prefix, then causal over the run's own tokens."""
        key = (n, prefix, str(device))
        if key not in self._masks:
            own = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            self._masks[key] = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), own], dim=1)
        return self._masks[key]


@dataclass
class Packed:
    """One row of all the batch's real tokens. `src` [M]: for each completion token the model
    scores (the batch's completion_mask nonzeros, in [B, T] order), the packed position whose
    hidden state predicts it."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    src: torch.Tensor  # [M]

    @classmethod
    def build(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], share: bool = True,
              reset_positions: bool = True) -> "Packed":
        """`share`: rows with the same prompt (anywhere in the batch) run it once; else each row
        is its own prompt + completion. `reset_positions` False: positions run on over the whole
        sequence (only for the negative control test)."""
        ids: list[int] = []
        pos: list[int] = []
        src: dict[tuple[int, int], int] = {}  # (row, t) -> packed index predicting completion token t
        groups: dict[tuple, list[int]] = {}
        for r, p in enumerate(prompt_ids):
            groups.setdefault(tuple(p) if share else (r,), []).append(r)
        for rows in groups.values():
            prompt = prompt_ids[rows[0]]
            if not prompt and any(completion_ids[r] for r in rows):
                raise GRPOError(f"packed batch: row {rows[0]} has a completion but an empty prompt (nothing predicts its first token)")
            base = len(ids)
            ids += prompt
            pos += range(len(prompt))
            for r in rows:
                c = completion_ids[r]
                if not c:
                    continue
                src[(r, 0)] = base + len(prompt) - 1  # the prompt's last token predicts the first
                start = len(ids)
                ids += c[:-1]
                pos += range(len(prompt), len(prompt) + len(c) - 1)
                for t in range(1, len(c)):
                    src[(r, t)] = start + t - 1
        order = sorted(src)  # [B, T] row-major: the order of completion_mask's nonzeros
        positions = pos if reset_positions else list(range(len(pos)))
        return cls(torch.tensor([ids], dtype=torch.long), torch.tensor([positions], dtype=torch.long),
                   torch.tensor([src[k] for k in order], dtype=torch.long))

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device) -> "Packed":
        return Packed(self.input_ids.to(device), self.position_ids.to(device), self.src.to(device))


def real_tokens(prompt_ids: list[list[int]], completion_ids: list[list[int]], share: bool = True) -> int:
    """Tokens `Packed.build` lays out: each prompt (once per distinct prompt when `share`) and
    each completion less its last token."""
    prompts = {tuple(p) for p in prompt_ids} if share else prompt_ids
    return sum(len(p) for p in prompts) + sum(max(0, len(c) - 1) for c in completion_ids)


def install(model) -> None:
    """Make `model` run `packed_attention` (registered once). A model on another attention than
    SDPA (eager, FlashAttention, flex) cannot pack: a one-line error naming the setting."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # unpacked forwards get SDPA's masks, as before
    config = model.config
    if config._attn_implementation == "sdpa":
        config._attn_implementation = ATTENTION
    elif config._attn_implementation != ATTENTION:
        raise GRPOError(f"train.packing on: the model runs {config._attn_implementation!r} attention; packing needs "
                        "'sdpa' (set train.packing off or auto)")


def resolve(setting: str, model) -> bool:
    """Whether `model` runs packed under `train.packing` `setting` (auto: wherever it can)."""
    if setting == "off":
        return False
    if setting == "on" and not supported(model):
        raise GRPOError(f"train.packing on: this model ({model.config.model_type}, {model.config._attn_implementation!r} "
                        "attention) cannot pack: it needs SDPA attention without a sliding window or a length-dependent rope "
                        "(set train.packing auto or off)")
    return supported(model)


def check_dir(model_dir, what: str = "model") -> None:
    """`grpo init` with train.packing on: the model in `model_dir` can pack, judged from its
    config.json (the model is built on the meta device: no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    try:
        resolve("on", model)
    except GRPOError as e:
        raise GRPOError(f"{what} {model_dir}: {e}") from None


ATTENTION_LAYERS = ("full_attention", "sliding_attention")
"""`config.layer_types` entries that mix tokens only through the attention function; any other
(linear attention, convolutions, SSMs: Qwen3.5, Qwen3-Next, LFM2) reads across packed sequences."""


def supported(model) -> bool:
    """Whether `model` can pack: SDPA attention reached through transformers' attention interface
    (Falcon's own attention classes never call it), no sliding window, no logit soft-capping, no
    token mixer besides attention, no rope that follows the batch's length."""
    import sys

    c = model.config
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: its base's modeling module
    interface = hasattr(sys.modules.get(type(base).__module__), "ALL_ATTENTION_FUNCTIONS")
    windowed = getattr(c, "sliding_window", None) is not None and getattr(c, "use_sliding_window", True)
    capped = getattr(c, "attn_logit_softcapping", None) is not None
    mixers = any(t not in ATTENTION_LAYERS for t in getattr(c, "layer_types", None) or ())
    return (c._attn_implementation in ("sdpa", ATTENTION) and interface and not windowed and not capped and not mixers
            and not _rope_follows_length(c))


def _rope_follows_length(config) -> bool:
    """Whether the rope frequencies follow the forward's largest position id (transformers'
    `dynamic_rope_update`: dynamic NTK, longrope). A packed forward's is a token short of the padded
    one's (a completion's last token is not run), so the two would rotate by other frequencies."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [rope] + [v for v in rope.values() if isinstance(v, dict)]  # per layer type: {"full_attention": {...}, ...}
    return any("dynamic" in str(k.get("rope_type", k.get("type", ""))) or k.get("rope_type") == "longrope" for k in kinds)


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     packed: Pieces | None = None, **kwargs):
    """transformers' attention-function contract (query [1, Hq, N, D], key/value [1, Hkv, N, D]
    -> ([1, N, Hq, D], None)); without `packed` pieces, transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise GRPOError("train.packing: this model's sliding-window attention cannot pack (set train.packing off)")
    packed.calls += 1
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for start, end, root, prefix in packed.runs:
        q = query[:, :, start:end]  # [1, Hq, n, D]
        k, v = key[:, :, start:end], value[:, :, start:end]
        mask = None
        if prefix:  # a completion after its shared prompt: the prompt's keys, then its own
            k = torch.cat([key[:, :, root : root + prefix], k], dim=2)
            v = torch.cat([value[:, :, root : root + prefix], v], dim=2)
            mask = packed.mask(end - start, prefix, query.device)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                   is_causal=mask is None and end - start > 1, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def packed_hidden(decoder, packed: Packed, arithmetic) -> torch.Tensor:
    """Hidden states [M, H] that predict the completion tokens, from one forward over the packed
    sequence under the `arithmetic` context (tokens.autocast)."""
    install(decoder)
    pieces = Pieces.from_positions(packed.position_ids[0].tolist())
    ones = torch.ones_like(packed.input_ids)  # no padding: SDPA's mask is skipped, the pieces do the masking
    with arithmetic:
        hidden = decoder(input_ids=packed.input_ids, attention_mask=ones, position_ids=packed.position_ids,
                         use_cache=False, packed=pieces).last_hidden_state  # [1, N, H]
    layers = decoder.config.num_hidden_layers
    if pieces.calls != layers:  # a layer that ignored the pieces ran the whole batch as one sequence
        raise GRPOError(f"train.packing: {pieces.calls} of this model's {layers} layers ({decoder.config.model_type}) ran "
                        "the packed attention; the others read across rows (set train.packing off)")
    return hidden[0].index_select(0, packed.src)
