"""Generation engines: vLLM (default, pipeline.models.vllm_engine) and transformers `generate`
(machines without vLLM, pipeline.models.hf_engine).

Both take token ids and a per-group seed and return G completions per prompt with the sampled
tokens' logprobs. A group is generated from its own seed, so a part's tokens do not depend on
which worker or which other groups share the engine. How an engine uses the machine (eager or
CUDA graphs, sleep mode, memory fraction) is decided in pipeline.models.device_budget.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config.rollout import RolloutConfig
from pipeline.models.engine_base import Sample, cpu_env, engine_dtype, environment_kept, model_context  # noqa: F401  (their home before)


def make_engine(model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                precision: str = "fp32", settings=None, files_ready=None):
    """`precision`: train.precision, which `rollout.dtype: auto` follows; `settings`: a vLLM engine's
    `device_budget.EngineSettings` (default: an engine alone on this machine's device); `files_ready`:
    what the engine calls before it reads weights from a directory (default: nothing to wait for)."""
    ready = {} if files_ready is None else {"files_ready": files_ready}
    from pipeline.quiet import captured

    if cfg.engine == "vllm":
        from pipeline.models.vllm_engine import VLLMEngine

        make = lambda: VLLMEngine(model_dir, cfg, max_model_len, seed, max_lora_rank=max_lora_rank, precision=precision, settings=settings, **ready)
    else:
        from pipeline.models.hf_engine import HFEngine

        make = lambda: HFEngine(model_dir, cfg, max_model_len, seed, max_lora_rank=max_lora_rank, precision=precision, **ready)
    with captured():  # vLLM's Triton note at import, its NUMA-binding warning from C++ at start
        return make()
