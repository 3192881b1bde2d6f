"""Generation engines: vLLM (default) and transformers `generate` (machines without vLLM).

Both take token ids and a per-group seed and return G completions per prompt with the sampled
tokens' logprobs. A group is generated from its own seed, so a part's tokens do not depend on
which worker or which other groups share the engine.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): engine start is 2-4 s instead of
12-19 s on the CPU, and new weights are loaded in place with `reload_weights`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import RolloutConfig
from pipeline.errors import GRPOError


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def cpu_env() -> None:
    """Environment the engines need on a CPU machine; set before vLLM/DeepSpeed import."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU notes drown the demo table
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a weight-loading bar per model load


@contextlib.contextmanager
def environment_kept():
    """Put os.environ back as it was. vLLM sets variables for its worker processes as it
    imports and starts (LD_PRELOAD of torch's libgomp, KMP_*, LD_LIBRARY_PATH,
    LOCAL_WORLD_SIZE, ...); its worker runs in this process here, so they would only leak into
    every process started later (a reward sandbox, a test's `grpo` command), which would then
    load other libraries than one started before any engine."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


class VLLMEngine:
    """vLLM's offline `LLM`, kept warm across iterations by `iterate`."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                 precision: str = "fp32"):
        cpu_env()
        self.dtype = engine_dtype(cfg.dtype, precision)
        with environment_kept():  # vLLM's settings for its worker processes stay its own
            try:
                from vllm import LLM
            except ImportError:
                raise GRPOError("rollout.engine vllm: vLLM is not installed (pip install 'grpo[cpu]' or 'grpo[gpu]'), or set rollout.engine: hf") from None
            if cfg.data_parallel_size > 1:  # vLLM 0.32's offline LLM raises on it
                raise GRPOError("rollout.data_parallel_size > 1 is not supported by vLLM's offline engine; run --shard i/N workers instead")
            self.cfg = cfg
            self.llm = LLM(
                model=str(model_dir),
                dtype=self.dtype,
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=True,
                tensor_parallel_size=cfg.tensor_parallel_size,
                data_parallel_size=cfg.data_parallel_size,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                logprobs_mode="processed_logprobs",  # after temperature, like the trainer's logprobs
                enable_prefix_caching=False,
                # a chunked prefill discards a sampled token and rewinds the request's generator,
                # which seeded CPU generators cannot do: schedule whole prompts only
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 16384),
                use_tqdm_on_load=False,  # a bar per in-place reload would interleave with the stage's own progress
                # VLLM_CPU_KVCACHE_SPACE, when set, overrides this (whole GiB only)
                kv_cache_memory_bytes=kv_cache_bytes(cfg, model_dir, max_model_len, self.dtype),
                # rollout.lora_mode vllm_lora: adapters served by vLLM's LoRA layers over the base
                **(dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1) if max_lora_rank else {}),
            )
        self.model_dir = Path(model_dir)
        self.adapter: Path | None = None  # a LoRA adapter directory to sample through (vllm_lora)
        self._lora_ids: dict[str, int] = {}
        self._serves_adapters = bool(max_lora_rank)
        self._kv_released = False
        self._weights_released = False

    def sleep(self) -> None:
        """Give the idle engine's memory back to the OS while the rest of an `iterate`
        iteration runs beside it: the KV cache, and the weights (their packed GEMM copies and
        the embedding), which the next iteration replaces by `load` anyway. The next `load` or
        `generate` takes them again and samples the same tokens. On a CPU only (on a GPU this
        is vLLM's sleep mode); an engine serving LoRA adapters keeps its base weights, which
        no iteration reloads."""
        if not self._kv_released:
            self._kv_released = all(self.llm.collective_rpc(_kv_release))
        if not self._weights_released and not self._serves_adapters:
            self._weights_released = all(self.llm.collective_rpc(_weights_release))
        if self._kv_released or self._weights_released:
            trim_heap()

    def wake(self) -> None:
        """Take the KV cache and the weights back (before anything generates through `self.llm`):
        the weights come again from `model_dir`, unless a `load` already brought new ones."""
        if self._kv_released:
            self.llm.collective_rpc(_kv_acquire)
            self._kv_released = False
        if self._weights_released:
            self.load(self.model_dir)

    def load(self, model_dir: Path) -> None:
        """Swap in new weights without restarting the engine (same architecture)."""
        if self._weights_released:  # the parameters get their memory back; the reload fills it
            self.llm.collective_rpc(_weights_acquire)
            self._weights_released = False
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        self.llm.collective_rpc(_retie_lm_head)
        self.model_dir = Path(model_dir)

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], n: int, greedy: bool = False,
                 max_tokens: list[int] | None = None) -> list[list[Sample]]:
        """`max_tokens`: a cap per prompt (an episode's turn), else rollout.max_new_tokens."""
        from vllm import SamplingParams

        c = self.cfg
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else c.temperature,
                top_p=1.0 if greedy else c.top_p,
                top_k=0 if greedy else c.top_k,
                min_p=0.0 if greedy else c.min_p,
                max_tokens=max_tokens[i] if max_tokens else c.max_new_tokens,
                stop=c.stop or None,
                seed=s,
                logprobs=0,
            )
            for i, s in enumerate(seeds)
        ]
        lora = None
        if self.adapter is not None:
            from vllm.lora.request import LoRARequest

            key = str(self.adapter)
            lora_id = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
            lora = LoRARequest(f"policy-{lora_id}", lora_id, key)
        self.wake()
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False, lora_request=lora)
        groups = []
        for out in outs:
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                lps = [float(next(iter(d.values())).logprob) if d else 0.0 for d in (o.logprobs or [])]
                tids = list(o.token_ids)
                group.append(Sample(o.text, tids, lps[: len(tids)], "length" if o.finish_reason == "length" else "stop"))
            groups.append(group)
        return groups

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()


def _model(worker):
    return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model


def _cpu_storages(tensors: list) -> list:
    """The distinct non-empty storages behind `tensors`, or none unless all are resizable CPU memory."""
    if not tensors or any(t.device.type != "cpu" or not t.untyped_storage().resizable() for t in tensors):
        return []
    return list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t.untyped_storage().nbytes()}.values())


def _free(worker, key: str, storages: list) -> bool:
    """Give `storages`' memory back; the tensors viewing them keep their (now empty) storage,
    whose sizes the worker keeps under `key` for `_restore`."""
    setattr(worker, key, [(st, st.nbytes()) for st in storages])
    for st in storages:
        st.resize_(0)
    return bool(storages)


def _restore(worker, key: str) -> list:
    """Give the storages `_free` emptied their size again (uninitialised memory); returns them."""
    storages = []
    for st, nbytes in getattr(worker, key, []):
        st.resize_(nbytes)
        storages.append(st)
    setattr(worker, key, [])
    return storages


def _kv_storages(worker) -> list:
    """The KV cache's backing storages (vLLM views one allocation per layer), if on a CPU."""
    kv = worker.model_runner.kv_caches
    tensors = list(kv.values()) if isinstance(kv, dict) else list(kv)
    while tensors and isinstance(tensors[0], (list, tuple)):
        tensors = [t for ts in tensors for t in ts]
    return _cpu_storages(tensors)


def _kv_release(worker) -> bool:
    """Free the KV cache's memory; its per-layer views keep their storage (now empty)."""
    return _free(worker, "grpo_kv_sizes", _kv_storages(worker))


def _kv_acquire(worker) -> None:
    import torch

    for st in _restore(worker, "grpo_kv_sizes"):
        torch.empty(0, dtype=torch.int8).set_(st).zero_()  # as vLLM allocates it: torch.zeros


def _weights_release(worker) -> bool:
    """Free the model's weights: the packed GEMM copies the CPU linears compute with (their
    oneDNN handlers are freed with them; the reload makes new ones) and the parameters' storage
    (the embedding, norms; a CPU linear's own weight is already empty). Buffers (the rotary
    cache) stay: no checkpoint restores them."""
    model = _model(worker)
    storages = _cpu_storages(list(model.parameters()))
    if not storages:
        return False
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is not None:
            module.cpu_linear = None
    return _free(worker, "grpo_weight_sizes", storages)


def _weights_acquire(worker) -> None:
    """Give the parameters their storage back (uninitialised: `reload_weights` fills it)."""
    _restore(worker, "grpo_weight_sizes")


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): what an engine just
    freed in small and medium blocks stays resident otherwise, and under the next stage's peak."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _retie_lm_head(worker) -> None:
    """vLLM 0.32's layerwise in-place reload skips a tied LM head ("ParallelLMHead: Failed to
    load weights"), so it keeps serving logits from the old embedding; on the CPU its GEMM was
    also prepacked from the old weight. Re-tie it to the reloaded embedding and re-pack."""
    model = _model(worker)
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


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

    def load(self, model_dir: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
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


def make_engine(model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                precision: str = "fp32"):
    """`precision`: train.precision, which `rollout.dtype: auto` follows."""
    from pipeline.quiet import captured

    cls = {"vllm": VLLMEngine, "hf": HFEngine}[cfg.engine]
    with captured():  # vLLM's Triton note at import, its NUMA-binding warning from C++ at start
        return cls(model_dir, cfg, max_model_len, seed, max_lora_rank=max_lora_rank, precision=precision)


def engine_dtype(dtype: str, precision: str) -> str:
    """The engine's dtype: `rollout.dtype`, or for auto the trainer's arithmetic on this machine
    (bfloat16 where `train.precision` resolves to bf16 autocast, else float32)."""
    if dtype != "auto":
        return dtype
    if precision == "auto":
        from pipeline.models.tokens import resolve_precision  # imports torch: only when there is something to resolve

        precision = resolve_precision(precision)
    return "bfloat16" if precision == "bf16" else "float32"


PROMPT_ALLOWANCE = 256
"""Prompt tokens per sequence assumed when sizing the KV cache (the engine starts before it sees
the prompts; a longer prompt only makes vLLM queue some sequences, never fail)."""
KV_FLOOR_BYTES = 256 << 20


def kv_cache_bytes(cfg: RolloutConfig, model_dir: Path, max_model_len: int, dtype: str) -> int:
    """The KV cache vLLM reserves: `rollout.kv_cache_gib`, or else what one part's sequences in
    flight need (groups_per_part x G, at most vLLM's 256 concurrent sequences) x (prompt allowance +
    max_new_tokens) tokens x 2 (K, V) x layers x KV heads x head size x dtype bytes, plus a quarter
    for block rounding; at least one max_model_len sequence and 256 MiB."""
    if cfg.kv_cache_gib is not None:
        return int(cfg.kv_cache_gib * (1 << 30))
    import json

    conf = json.loads((Path(model_dir) / "config.json").read_text())
    conf = conf.get("text_config", conf)
    heads = int(conf.get("num_attention_heads") or 1)
    kv_heads = int(conf.get("num_key_value_heads") or heads)
    head_dim = int(conf.get("head_dim") or int(conf.get("hidden_size", 0)) // heads)
    per_token = 2 * int(conf.get("num_hidden_layers", 1)) * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    seqs = min(cfg.groups_per_part, cfg.prompts_per_iter) * cfg.num_generations
    tokens = min(seqs, 256) * min(max_model_len, PROMPT_ALLOWANCE + cfg.max_new_tokens)
    return int(max(KV_FLOOR_BYTES, per_token * max(max_model_len, tokens * 5 // 4)))


def model_context(model_dir: Path) -> int:
    import json

    conf = json.loads((Path(model_dir) / "config.json").read_text())
    return int(conf.get("max_position_embeddings") or 2048)
