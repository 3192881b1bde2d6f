"""transformers `generate` as a rollout engine (`rollout.engine: hf`): slower than vLLM, but it
needs nothing beyond the training stack. A group is sampled from its own seed, as with vLLM."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import RolloutConfig
from pipeline.models.engine_base import Sample, cpu_env, engine_dtype


class HFEngine:
    """transformers `generate`: slower, but needs nothing beyond the training stack."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                 precision: str = "fp32"):
        cpu_env()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.dtype = engine_dtype(cfg.dtype, precision)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model_dir = Path(model_dir)
        self.adapter = None  # LoRA policies reach this engine as merged weights

    def load(self, model_dir: Path, weights: list | None = None) -> None:
        """New weights: those stored in `model_dir`, or `weights` ((name, tensor) pairs) equal to them."""
        from safetensors.torch import load_file

        state = dict(weights or [])
        for f in sorted(Path(model_dir).glob("*.safetensors")) if weights is None else []:
            state.update(load_file(f))
        self.model.load_state_dict(state, strict=False)
        self.model.tie_weights()
        self.model_dir = Path(model_dir)

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], n: int, greedy: bool = False,
                 max_tokens: list[int] | None = None) -> list[list[Sample]]:
        torch, c, tok = self.torch, self.cfg, self.tokenizer
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else tok.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_ids))
        groups = []
        for i, (ids, seed) in enumerate(zip(prompt_ids, seeds)):
            torch.manual_seed(seed)  # one group, one seed: independent of batching
            inp = torch.tensor([ids] * (1 if greedy else n))
            kw = dict(do_sample=False) if greedy else dict(
                do_sample=True, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k or None, min_p=c.min_p or None
            )
            with torch.no_grad():
                out = self.model.generate(
                    inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens[i] if max_tokens else c.max_new_tokens, pad_token_id=pad,
                    eos_token_id=list(eos_ids), output_scores=True, return_dict_in_generate=True, **kw,
                )
            new = out.sequences[:, len(ids):]  # [n, L]
            # `scores` are the processed logits (temperature, top-k/p) the sampler drew from
            logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [n, L, V]
            tok_lp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [n, L]
            group = []
            for j in range(new.shape[0]):
                row = new[j].tolist()
                end = next((t + 1 for t, x in enumerate(row) if x in eos_ids), None)
                length = end if end is not None else len(row)
                tids = row[:length]
                text = tok.decode(tids, skip_special_tokens=True)
                reason = "stop" if end is not None else "length"
                text, tids, reason = _apply_stop(text, tids, reason, c.stop, tok)
                group.append(Sample(text, tids, [float(x) for x in tok_lp[j, : len(tids)]], reason))
            groups.append(group * (n if greedy else 1))
        return groups

    def close(self) -> None:
        del self.model


def _apply_stop(text, tids, reason, stops, tok):
    """Cut at the first stop string, as vLLM does (the stop string is not included)."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut < 0:
        return text, tids, reason
    kept = text[:cut]
    for n in range(len(tids) + 1):
        if len(tok.decode(tids[:n], skip_special_tokens=True)) >= len(kept):
            return kept, tids[:n], "stop"
    return kept, tids, "stop"


