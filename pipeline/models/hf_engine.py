"""transformers `generate` as a rollout engine (`rollout.engine: hf`): slower than vLLM, but it
needs nothing beyond the training stack. A group is sampled from its own seed, as with vLLM.

It samples what the trainer scores: softmax(logits / temperature), truncated only by the
config's top_p / top_k / min_p (which `grpo init` refuses beside the rollout correction).
`generate` would otherwise take every processor the model directory's generation_config.json
sets (Qwen2.5-Instruct ships repetition_penalty 1.05-1.1; others no_repeat_ngram_size,
bad_words_ids, suppress_tokens, min_new_tokens, ...), a policy the trainer never scores. So
the model keeps no generation config of its own beyond its stop tokens (pipeline/models/stop_tokens.py),
and each call passes a complete one built from the config (`sampling_config`)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.rollout import RolloutConfig
from pipeline.models.engine_base import Sample, cpu_env, engine_dtype, files_ready
from pipeline.models.kernels import same_kernels_every_run
from pipeline.models.stop_tokens import stop_token_ids


class HFEngine:
    """transformers `generate`: slower, but needs nothing beyond the training stack."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                 precision: str = "fp32", files_ready=files_ready):
        """`files_ready(model_dir)`: called before weights are read from a directory (engine_base.files_ready)."""
        cpu_env()
        same_kernels_every_run()  # the same tokens from the same seed on a GPU
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.cfg = cfg
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.dtype = engine_dtype(cfg.dtype, precision)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # how a call's groups are drawn (rollout.hf_sampler; null: as runs made before it did)
        self.sampler = cfg.hf_sampler or ("gumbel" if self.device.type == "cuda" else "per_group")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        # the stop tokens are the one thing taken from the model's files (the eos ids of its
        # generation_config.json and tokenizer, and its template's end of turn), as for vLLM
        self.stop_ids = stop_token_ids(model_dir, self.tokenizer)
        self.pad_id = next((i for i in (self.tokenizer.pad_token_id, *self.stop_ids) if i is not None), 0)
        # `generate` fills every unset field of the config it is given from the model's own: keep none
        self.model.generation_config = GenerationConfig(eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        self.model_dir = Path(model_dir)
        self.adapter = None  # LoRA policies reach this engine as merged weights
        self.files_ready = files_ready

    def load(self, model_dir: Path, weights: list | None = None) -> None:
        """New weights: those stored in `model_dir`, or `weights` ((name, tensor) pairs, or a
        function giving them) equal to them."""
        from pipeline.models.strict import load_dir_strict, load_strict

        weights = weights() if callable(weights) else weights

        if weights is None:  # every weight, or a one-line error
            self.files_ready(model_dir)
            load_dir_strict(self.model, model_dir, f"rollout engine: {model_dir}")
        else:
            load_strict(self.model, dict(weights), f"rollout engine: {model_dir}")
        self.model.tie_weights()
        self.model_dir = Path(model_dir)

    def probe(self, ids: list[int]) -> list[float]:
        """Logprobs of ids[1:] given the tokens before each, at temperature 1, as this engine
        computes them (pipeline.run.sampler_proof)."""
        torch = self.torch
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, :-1].float().cpu()  # [P-1, V]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], n: int, greedy: bool = False,
                 max_tokens: list[int] | None = None, temperature: float | None = None) -> list[list[Sample]]:
        """`temperature`: the eval's, else rollout.temperature."""
        if self.sampler != "per_group":
            return self._generate_batched(prompt_ids, seeds, n, greedy, max_tokens, temperature)
        torch, c, tok = self.torch, self.cfg, self.tokenizer
        stop_ids = set(self.stop_ids)
        groups = []
        for i, (ids, seed) in enumerate(zip(prompt_ids, seeds)):
            torch.manual_seed(seed)  # one group, one seed: independent of batching
            inp = torch.tensor([ids] * (1 if greedy else n))
            gen = sampling_config(c, greedy, max_tokens[i] if max_tokens else c.max_new_tokens, self.stop_ids, self.pad_id,
                                  temperature)
            with torch.no_grad():
                out = self.model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gen)
            new = out.sequences[:, len(ids):]  # [n, L]
            # `scores` are the processed logits (temperature, top-k/p) the sampler drew from; each
            # step's log softmax is gathered at its token alone (not stacked into an [n, L, V] copy)
            tok_lp = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, new[:, t, None])[:, 0]
                                  for t, s in enumerate(out.scores)], 1)  # [n, L]
            group = []
            for j in range(new.shape[0]):
                row = new[j].tolist()
                end = next((t + 1 for t, x in enumerate(row) if x in stop_ids), None)  # the stop token kept
                length = end if end is not None else len(row)
                tids = row[:length]
                text = tok.decode(tids, skip_special_tokens=True)
                reason = "stop" if end is not None else "length"
                text, tids, reason = _apply_stop(text, tids, reason, c.stop, tok)
                group.append(Sample(text, tids, [float(x) for x in tok_lp[j, : len(tids)]], reason))
            groups.append(group * (n if greedy else 1))
        return groups

    def _generate_batched(self, prompt_ids, seeds, n, greedy, max_tokens, temperature=None):
        """Every group of the call in one left-padded `generate` batch (one step of 64 rows costs
        far less than 8 steps of 8, on a GPU and on a CPU), each group still drawn from its own
        seed: `GroupSampler` samples softmax(logits / temperature) with the group's own generator
        (inverse CDF or Gumbel-max, `self.sampler`), so a group's tokens do not depend on the torch
        global generator."""
        from transformers import LogitsProcessorList

        torch, c = self.torch, self.cfg
        copies = 1 if greedy else n
        budgets = list(max_tokens) if max_tokens else [c.max_new_tokens] * len(prompt_ids)
        width = max(len(ids) for ids in prompt_ids)
        rows = [ids for ids in prompt_ids for _ in range(copies)]
        inp = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=self.device)
        sampler = GroupSampler(c, greedy, seeds, copies, self.device, temperature, draw=self.sampler)
        gen = sampling_config(c, True, max(budgets), self.stop_ids, self.pad_id)  # argmax of what the sampler returns
        gen.output_scores = False
        with torch.no_grad():
            out = self.model.generate(inp, attention_mask=mask, generation_config=gen,
                                      logits_processor=LogitsProcessorList([sampler]))
        new = out.sequences[:, width:].tolist()
        tok_lp = torch.stack(sampler.chosen, 1).tolist() if sampler.chosen else [[] for _ in rows]
        stop_ids, groups = set(self.stop_ids), []
        for i in range(len(prompt_ids)):
            group = []
            for j in range(i * copies, (i + 1) * copies):
                row = new[j][: budgets[i]]
                end = next((t + 1 for t, x in enumerate(row) if x in stop_ids), None)
                tids = row[: end if end is not None else len(row)]
                text = self.tokenizer.decode(tids, skip_special_tokens=True)
                text, tids, reason = _apply_stop(text, tids, "stop" if end is not None else "length", c.stop, self.tokenizer)
                group.append(Sample(text, tids, [float(x) for x in tok_lp[j][: len(tids)]], reason))
            groups.append(group * (n if greedy else 1))
        return groups

    def close(self) -> None:
        del self.model


class GroupSampler:
    """A logits processor that samples itself, rows grouped `copies` at a time, each group from
    its own generator g, a draw from p = softmax(logits / T) truncated by the config's top_k /
    top_p / min_p (or the plain argmax when greedy):
    - draw "batched": inverse CDF. One float64 uniform u per row from g; the token is the first
      whose cumulative probability (summed in float64) exceeds u x the total; its logprob is log p there. A softmax and a
      cumulative sum over the vocabulary for all rows, and k uniforms per group.
    - draw "gumbel": argmax(log p + Gumbel noise), the noise a vocabulary of uniforms per row from
      g; its logprob is log_softmax(logits / T) there.
    It keeps the chosen tokens' logprobs and hands `generate` a score that makes its argmax that token."""

    def __init__(self, cfg: RolloutConfig, greedy: bool, seeds: list[int], copies: int, device, temperature: float | None = None,
                 draw: str = "gumbel"):
        import torch
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.torch, self.greedy, self.copies, self.draw = torch, greedy, copies, draw
        self.temperature = cfg.temperature if temperature is None else temperature  # `temperature`: the eval's
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.warpers = [w for w in (TopKLogitsWarper(cfg.top_k) if cfg.top_k and cfg.top_k > 0 else None,
                                    TopPLogitsWarper(cfg.top_p) if cfg.top_p < 1.0 else None,
                                    MinPLogitsWarper(cfg.min_p) if cfg.min_p else None) if w is not None]
        self.chosen: list = []
        self._buffers: list = [None, None]  # [B, V] buffers (uniforms; probabilities, their cumulative sums)

    def __call__(self, input_ids, scores):
        # Each draw is the same ops on the same [B, V] float32 shapes as its plain out-of-place form
        # (tests/test_engines.py holds both as references), only in place and in a buffer kept
        # across steps: the same tokens and logprobs bit for bit, with fewer passes over the
        # vocabulary and no allocation per step (s - log(-log u) is exactly s + (-log(-log u))).
        torch = self.torch
        s = scores.float()
        if not self.greedy:
            if self.temperature != 1.0:  # x / 1 is x to the bit: no pass over the vocabulary for it
                s = s / self.temperature  # a copy: `scores` is not changed
            for w in self.warpers:  # transformers' warpers mask out of place
                s = w(input_ids, s)
        k, out = self.copies, None
        if self.greedy:
            choice = s.argmax(-1)
            chosen = torch.log_softmax(s, -1).gather(-1, choice[:, None])
        elif self.draw == "batched":
            # u and the cumulative sums in float64: a float32 uniform takes 2^24 values and a float32
            # cumulative sum near 1 steps by 2^-24, so a token of p below 6e-8 (most of a 150k
            # vocabulary at T = 1, ~1e-3 of its mass) would be drawn with probability 0 or a multiple
            # of 2^-24, not p (a total variation of ~1e-3 a step); float64 resolves p down to ~1e-16
            u = torch.cat([torch.rand(k, generator=g, device=s.device, dtype=torch.float64) for g in self.gens])[:, None]  # [B, 1]
            p = torch.softmax(s, -1, out=self._buffer(0, s))  # 0 where a warper truncated the token to -inf
            cdf = self._buffer(1, s, torch.float64).copy_(p).cumsum_(-1)  # as fast as float32's cumsum on a CPU
            total = cdf[:, -1:]
            # u x total is kept below total (rounding could reach it), so the token found has p > 0
            target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
            choice = torch.searchsorted(cdf, target, right=True)[:, 0]
            chosen = p.gather(-1, choice[:, None]).log_()
            out = p  # read by `generate` for its argmax alone (output_scores off), then free again
        else:
            logp = torch.log_softmax(s, -1)
            u = self._buffer(0, s)
            for i, g in enumerate(self.gens):  # each group's uniforms from its own generator, into its rows
                torch.rand((k, s.shape[-1]), generator=g, device=s.device, out=u[i * k:(i + 1) * k])
            u.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().log_()  # log(-log u)
            choice = torch.sub(s, u, out=u).argmax(-1)  # argmax(s + Gumbel noise)
            chosen = logp.gather(-1, choice[:, None])
        self.chosen.append(chosen.squeeze(-1))
        if out is None:
            out = s if s is not scores else torch.empty_like(s)  # s is ours once divided by T
        return out.fill_(float("-inf")).scatter_(-1, choice[:, None], 0.0)

    def _buffer(self, i: int, like, dtype=None):
        """Buffer i, [B, V] (float32 unless `dtype`) on the scores' device, kept across steps: a
        fresh one each step is a fresh allocation whose first touch faults in every page (on a CPU,
        as long as the arithmetic itself)."""
        dtype = dtype or self.torch.float32
        buf = self._buffers[i]
        if buf is None or buf.shape != like.shape or buf.device != like.device or buf.dtype != dtype:
            buf = self._buffers[i] = self.torch.empty(like.shape, dtype=dtype, device=like.device)
        return buf


def sampling_config(c: RolloutConfig, greedy: bool, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                    temperature: float | None = None):
    """The whole generation config of one call: the config's sampling settings, every other
    logits processor off (their neutral values, so nothing is filled in from a model's own);
    `stop_ids` end a row (pipeline/models/stop_tokens.py)."""
    from transformers import GenerationConfig

    off = dict(
        num_beams=1, min_new_tokens=0, min_length=0, forced_bos_token_id=None, forced_eos_token_id=None,
        top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
        repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
        bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None, sequence_bias=None,
        exponential_decay_length_penalty=None, renormalize_logits=False, remove_invalid_values=False,
    )
    t = c.temperature if temperature is None else temperature  # `temperature`: the eval's
    sampled = {} if greedy else dict(temperature=t, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p or None)
    return GenerationConfig(**off | sampled, do_sample=not greedy, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                            pad_token_id=pad_id, output_scores=True, return_dict_in_generate=True)


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


