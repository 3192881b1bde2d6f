"""Generation engines: vLLM (default, pipeline.models.vllm_engine) and transformers `generate`
(machines without vLLM, pipeline.models.hf_engine).

Both take token ids and a per-group seed and return G completions per prompt with the sampled
tokens' logprobs. A group is generated from its own seed, so a part's tokens do not depend on
which worker or which other groups share the engine. How an engine uses the machine (eager or
CUDA graphs, sleep mode, memory fraction) is decided in pipeline.models.device_plan.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import RolloutConfig


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


def make_engine(model_dir: Path, cfg: RolloutConfig, max_model_len: int, seed: int, max_lora_rank: int | None = None,
                precision: str = "fp32", plan=None):
    """`precision`: train.precision, which `rollout.dtype: auto` follows; `plan`: a vLLM engine's
    `device_plan.EnginePlan` (default: an engine alone on this machine's device)."""
    from pipeline.quiet import captured

    if cfg.engine == "vllm":
        from pipeline.models.vllm_engine import VLLMEngine

        make = lambda: VLLMEngine(model_dir, cfg, max_model_len, seed, max_lora_rank=max_lora_rank, precision=precision, plan=plan)
    else:
        from pipeline.models.hf_engine import HFEngine

        make = lambda: HFEngine(model_dir, cfg, max_model_len, seed, max_lora_rank=max_lora_rank, precision=precision)
    with captured():  # vLLM's Triton note at import, its NUMA-binding warning from C++ at start
        return make()


def engine_dtype(dtype: str, precision: str, device=None) -> str:
    """The engine's dtype on `device` (default: this machine's): `device_plan.engine_dtype`."""
    from pipeline.models import device_plan

    return device_plan.engine_dtype(dtype, precision, device or device_plan.this_device())


def model_context(model_dir: Path) -> int:
    import json

    conf = json.loads((Path(model_dir) / "config.json").read_text())
    return int(conf.get("max_position_embeddings") or 2048)
