"""vLLM's offline `LLM` as the rollout engine, kept warm across iterations by `iterate`.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): engine start is 2-4 s instead of
12-19 s on the CPU, and new weights are loaded in place with `reload_weights`, from the stored
policy directory or (rollout.weight_sync memory) from the trainer's tensors. How it uses the
device (eager or CUDA graphs, memory fraction, sleep mode) is a `device_budget.EngineSettings`.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pipeline.config.rollout import RolloutConfig
from pipeline.errors import GRPOError
from pipeline.models import engine_memory as mem
from pipeline.models.device_budget import EngineSettings, engine_settings_for, this_device
from pipeline.models.engine_base import Sample, cpu_env, environment_kept, files_ready
from pipeline.models.stop_tokens import stop_token_ids


def _env_kept(method):
    """`method` run inside `environment_kept`: what vLLM and torch set in os.environ as they run
    (torch's compiled-kernel loader leaves a pointer of this process there) stays out of the
    processes started later."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with environment_kept():
            return method(*args, **kwargs)

    return wrapper


class VLLMEngine:
    """vLLM's offline `LLM`, kept warm across iterations by `iterate`."""

    def __init__(self, model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                 precision: str = "fp32", settings: EngineSettings | None = None, files_ready=files_ready):
        """`settings`: how the engine uses the device (default: an engine alone on this machine's);
        `files_ready(model_dir)`: called before weights are read from a directory, a wake's reload too
        (engine_base.files_ready)."""
        cpu_env()
        from transformers import AutoTokenizer

        settings = settings or engine_settings_for(cfg, model_dir, max_model_len, precision, this_device())
        # vLLM stops on the eos ids of the model's files; a template's end of turn they do not
        # list (pipeline/models/stop_tokens.py) it is given as stop_token_ids, with the rest
        self.stop_ids = stop_token_ids(model_dir, AutoTokenizer.from_pretrained(model_dir))
        self.settings, self.dtype = settings, settings.dtype
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
                enforce_eager=settings.enforce_eager,
                tensor_parallel_size=cfg.tensor_parallel_size,
                data_parallel_size=cfg.data_parallel_size,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                logprobs_mode="processed_logprobs",  # after temperature, like the trainer's logprobs
                enable_prefix_caching=False,
                # a chunked prefill discards a sampled token and rewinds the request's generator,
                # which seeded CPU generators cannot do: schedule whole prompts only
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_model_len, 16384),
                use_tqdm_on_load=False,  # a bar per in-place reload would interleave with the stage's own progress
                # on a CPU VLLM_CPU_KVCACHE_SPACE, when set, overrides this (whole GiB only)
                **(dict(kv_cache_memory_bytes=settings.kv_cache_bytes) if settings.kv_cache_bytes is not None else {}),
                # on a GPU, vLLM's sleep mode frees its memory while `iterate` trains
                **(dict(enable_sleep_mode=True) if settings.sleep_level is not None else {}),
                # rollout.lora_mode vllm_lora: adapters served by vLLM's LoRA layers over the base
                **(dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1) if max_lora_rank else {}),
            )
        self.model_dir = Path(model_dir)
        self.adapter: Path | None = None  # a LoRA adapter directory to sample through (vllm_lora)
        self._lora_ids: dict[str, int] = {}
        self._serves_adapters = bool(max_lora_rank)
        self._kv_released = False
        self._weights_released = False
        self._asleep: set[str] = set()  # vLLM sleep mode: the memory tags not yet woken
        self._weights_stale = False  # level 2 discarded the weights: a wake reloads them
        self._reload = None  # what gives the weights again when `model_dir` does not hold them (load)
        self.files_ready = files_ready

    @_env_kept
    def sleep(self) -> None:
        """Give the idle engine's memory back while the rest of an `iterate` iteration runs
        beside it: the KV cache, and the weights, which the next iteration replaces by `load`
        anyway. The next `load` or `generate` takes them again and samples the same tokens.
        On a GPU this is vLLM's sleep mode at the settings' level; on a CPU the engine empties the
        KV cache's and the weights' storage itself. An engine serving LoRA adapters keeps its
        base weights (offloaded to host memory on a GPU), which no iteration reloads."""
        if self.settings.sleep_level is not None:
            if not self._asleep:
                self.llm.sleep(level=self.settings.sleep_level)
                self._asleep = {"weights", "kv_cache"}
                self._weights_stale = self.settings.sleep_level >= 2
            return
        if not self._kv_released:
            self._kv_released = all(self.llm.collective_rpc(mem.kv_release))
        if not self._weights_released and not self._serves_adapters:
            self._weights_released = all(self.llm.collective_rpc(mem.weights_release))
        if self._kv_released or self._weights_released:
            mem.trim_heap()

    @_env_kept
    def wake(self) -> None:
        """Take the KV cache and the weights back (before anything generates through `self.llm`):
        the weights come again from `model_dir`, unless a `load` already brought new ones."""
        if self._asleep:
            if "weights" in self._asleep and self._weights_stale:
                self.load(self.model_dir, self._reload)
            self._wake({"weights", "kv_cache"})
            return
        if self._kv_released:
            self.llm.collective_rpc(mem.kv_acquire)
            self._kv_released = False
        if self._weights_released:
            self.load(self.model_dir, self._reload)

    def _wake(self, tags: set[str]) -> None:
        tags = tags & self._asleep
        if tags:
            self.llm.wake_up(tags=sorted(tags))
            self._asleep -= tags

    @_env_kept
    def load(self, model_dir: Path, weights: list | None = None) -> None:
        """Swap in new weights without restarting the engine (same architecture): those stored
        in `model_dir`, or `weights` ((name, tensor) pairs as the checkpoint names them, e.g.
        the trainer's) that equal them, or a function giving such pairs (a merged LoRA policy: kept
        to reload them after a sleep discarded the weights). `model_dir` then names what the engine holds."""
        self._reload = weights if callable(weights) else None
        weights = weights() if callable(weights) else weights
        if weights is None:  # before the engine's state changes: a policy still being written is waited for
            self.files_ready(model_dir)
        if "weights" in self._asleep:  # their memory back (level 2: uninitialised; the reload fills it)
            self._wake({"weights"})
            self._weights_stale = False
        if self._weights_released:  # the parameters get their memory back; the reload fills it
            self.llm.collective_rpc(mem.weights_acquire)
            self._weights_released = False
        if weights is None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        else:  # in-process only: the worker reads these very tensors
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.collective_rpc(_retie_lm_head)
        self.model_dir = Path(model_dir)

    @_env_kept
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], n: int, greedy: bool = False,
                 max_tokens: list[int] | None = None, temperature: float | None = None) -> list[list[Sample]]:
        """`max_tokens`: a cap per prompt (an episode's turn), else rollout.max_new_tokens;
        `temperature`: the eval's, else rollout.temperature."""
        from vllm import SamplingParams

        c = self.cfg
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else (c.temperature if temperature is None else temperature),
                top_p=1.0 if greedy else c.top_p,
                top_k=0 if greedy else c.top_k,
                min_p=0.0 if greedy else c.min_p,
                max_tokens=max_tokens[i] if max_tokens else c.max_new_tokens,
                stop=c.stop or None,
                stop_token_ids=self.stop_ids,  # the token is kept in token_ids, as an eos is
                seed=s,
                logprobs=0,
            )
            for i, s in enumerate(seeds)
        ]
        self.wake()
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False, lora_request=self._lora())
        groups = []
        for out in outs:
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                lps = [float(next(iter(d.values())).logprob) if d else 0.0 for d in (o.logprobs or [])]
                tids = list(o.token_ids)
                group.append(Sample(o.text, tids, lps[: len(tids)], "length" if o.finish_reason == "length" else "stop"))
            groups.append(group)
        return groups

    def _lora(self):
        """The LoRA request of the adapter this engine samples through (rollout.lora_mode vllm_lora), or None."""
        if self.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        key = str(self.adapter)
        lora_id = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
        return LoRARequest(f"policy-{lora_id}", lora_id, key)

    @_env_kept
    def probe(self, ids: list[int]) -> list[float]:
        """Logprobs of ids[1:] given the tokens before each, at temperature 1, as this engine
        computes them (its prompt logprobs: the raw logits' log-softmax; pipeline.run.sampler_proof)."""
        from vllm import SamplingParams

        self.wake()
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self._lora())[0]
        return [float(d[t].logprob) for t, d in zip(ids[1:], out.prompt_logprobs[1:])]

    def close(self) -> None:
        """The engine shut down now, not when the LLM object is collected: a Ctrl-C's traceback holds it
        (its frames inside generate) until the command has ended, and by then the trainer has torn
        the process group down (it joined vLLM's, pipeline.update.distributed.close_distributed), so
        vLLM's own teardown of its groups failed ("Invalid process group specified", a stray traceback)."""
        import gc

        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None and hasattr(client, "shutdown"):
            client.shutdown()  # vLLM's teardown once (its finalizer is detached), its groups still there
        del self.llm
        gc.collect()


def _retie_lm_head(worker) -> None:
    """vLLM 0.32's layerwise in-place reload skips a tied LM head ("ParallelLMHead: Failed to
    load weights"), so it keeps serving logits from the old embedding; on the CPU its GEMM was
    also prepacked from the old weight. Re-tie it to the reloaded embedding and re-pack."""
    model = mem.worker_model(worker)
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)
