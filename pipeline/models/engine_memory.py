"""Memory of a vLLM engine on the CPU: the KV cache's size, and giving the KV cache and the
weights back to the OS while an idle engine sleeps beside the trainer (`iterate`).

On a GPU vLLM's own sleep mode does this (pipeline.models.device_budget says which path runs);
the functions here find no CPU storage there and release nothing. Those taking a `worker` run
inside vLLM's worker through `collective_rpc`.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config.rollout import RolloutConfig


def worker_model(worker):
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


def kv_release(worker) -> bool:
    """Free the KV cache's memory; its per-layer views keep their storage (now empty)."""
    return _free(worker, "grpo_kv_sizes", _kv_storages(worker))


def kv_acquire(worker) -> None:
    import torch

    for st in _restore(worker, "grpo_kv_sizes"):
        torch.empty(0, dtype=torch.int8).set_(st).zero_()  # as vLLM allocates it: torch.zeros


def weights_release(worker) -> bool:
    """Free the model's weights: the packed GEMM copies the CPU linears compute with (their
    oneDNN handlers are freed with them; the reload makes new ones) and the parameters' storage
    (the embedding, norms; a CPU linear's own weight is already empty). Buffers (the rotary
    cache) stay: no checkpoint restores them."""
    model = worker_model(worker)
    storages = _cpu_storages(list(model.parameters()))
    if not storages:
        return False
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is not None:
            module.cpu_linear = None
    return _free(worker, "grpo_weight_sizes", storages)


def weights_acquire(worker) -> None:
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


